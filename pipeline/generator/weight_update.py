"""Weight updates of the generator driver: receiving a new policy version and swapping it into the
running vLLM engine so that every token's version label stays exact.

`WeightUpdateMixin` is mixed into `pipeline.generator.engine.Generator` (``self.engine``,
``self.config``, ``self.version``, ``self.weight_sync`` and the update state ``_update_lock``,
``_poster``, ``_abort_epoch`` come from the Generator); its methods run on the Generator's asyncio
loop and reach the engine's workers (`pipeline.generator.worker_extension`) through
``collective_rpc``.

Invariants:
- A weight update (`update_weights`) runs under one lock and applies the configured interrupt mode:
  ``keep``   pause with in-flight requests frozen (their KV is dropped), load, reset the prefix
             cache, relabel, resume: they recompute their prefix on the new weights and continue;
  ``keep_kv`` pause with in-flight requests frozen and their KV kept, load, relabel, resume: the
             pause is the swap alone; their earlier tokens' KV stays the old weights'. Prefix
             blocks are salted with the version a request was admitted under (vLLM's
             ``cache_salt``), so no request admitted after an update reuses blocks from before;
  ``drain``  pause admitting, let in-flight requests finish, then load;
  ``abort``  abort in-flight requests; each resumes as a new request whose prompt is prompt +
             partial completion with the remaining budget; the sample is the concatenation
             (tokens, logprobs, versions) of its segments, finish reason that of the last segment.
  In ``keep`` and ``keep_kv`` the pause, the load, the relabel (and ``keep``'s cache reset) go to
  the engine core as one batch of calls, handled in order between engine steps, and the resume
  follows once all succeeded: the pause costs the engine step in progress, the load and one round
  trip. The label is exact by construction: vLLM's engine core labels a step's tokens with its
  version when it processes the step's output (`EngineCore._attach_weight_version`), a paused
  scheduler schedules no token, and the load and relabel are handled after the pause. Where the
  engine core overlaps steps (async scheduling or pipeline parallelism: a batch queue, so a step
  dispatched before the pause may have its output processed after it), the batch waits for the
  pause's answer (given once that queue is empty), one round trip more.
  Staged (``weight_sync``) the update is first received in the background while generation goes
  on; a failed receive raises `WeightReceiveError` and changes nothing. When every worker also
  built the update's kernel form there (``prepared``, `pipeline.generator.kernel_swap`), the load
  in the pause is a swap of references. The resume cannot join the batch: vLLM answers a keep
  pause only once its engine core is idle, and a resume handled before that leaves the pause
  unanswered while requests keep it busy. Streamed, it is received
  and loaded bucket by bucket inside the pause. If loading fails inside the pause the engine stays
  paused (its weights may be half-written) and `WeightUpdateError` propagates: the caller must
  load a complete version (rejoin the group) before generating again, so no engine ever serves a
  mix of two versions.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pipeline.protocol.codec import MessageError
from pipeline.protocol.worker_status import Received, received_state


_STAGING_POLL_S = 0.005  # how often the driver asks whether a staged receive has finished
_PAUSE_MODE = {"keep": "keep", "keep_kv": "keep", "drain": "wait", "abort": "abort"}


class WeightUpdateError(RuntimeError):
    """A weight update failed; the engine is left paused until a complete version is loaded."""


class WeightReceiveError(RuntimeError):
    """A staged update could not be received; the engine keeps generating on its current weights."""


@dataclass
class UpdateReport:
    version: int
    paused_s: float
    """Pause to resume: the generator's stall."""
    load_s: float
    """Loading the weights inside the pause (receiving too unless staged)."""
    staging_s: float = 0.0
    """Receiving in the background before the pause (staged updates only)."""
    mode: str = "staged"
    """'staged', 'streamed' or 'checkpoint' (loaded from a path)."""
    worker_load_s: float = 0.0
    """Of `load_s`, the slowest worker's own time loading (receiving too unless staged): the rest
    of the pause is waiting for the engine step in progress and round trips to the engine."""
    prepared: bool = False
    """Staged only: every worker built the update's kernel form while generating, so the pause only
    swapped references (`pipeline/generator/kernel_swap.py`); else it was loaded in place."""
    received_bytes: int = 0
    """Bytes the weight channel counted receiving the update, at the worker that counted most (each
    worker receives the whole update); 0 from a checkpoint."""


class WeightUpdateMixin:
    """The Generator's weight group and update methods (module docstring)."""

    async def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int,
                                backend: str = "gloo", epoch: int = 0, senders: int = 1, *, secret: bytes) -> list[int]:
        """Each engine worker joins the weight group (``senders`` trainer ranks send; the channel
        is ``config.weight_channel``; ``secret``: the run's, signs the group's store); returns their ranks."""
        return await self.engine.collective_rpc(
            "join_weight_group", args=(host, port, first_rank, world_size, self.config.weight_timeout_s, secret,
                                       backend, epoch, senders, self.config.weight_channel))

    async def start_joining_weight_group(self, host: str, port: int, first_rank: int, world_size: int,
                                         backend: str = "gloo", epoch: int = 0, senders: int = 1, *,
                                         secret: bytes) -> list[int]:
        """Like `join_weight_group`, but returns at once: each worker forms the group on a background
        thread and stays in the group in use until `use_weight_group` (epoch)."""
        return await self.engine.collective_rpc(
            "start_joining_weight_group", args=(host, port, first_rank, world_size, self.config.weight_timeout_s,
                                                secret, backend, epoch, senders, self.config.weight_channel))

    async def use_weight_group(self, epoch: int) -> None:
        """Switch every worker to weight group ``epoch`` (waits until it formed)."""
        await self.engine.collective_rpc("use_weight_group", args=(epoch,))

    async def update_weights(self, version: int | None = None, path: str | None = None) -> UpdateReport:
        """Load a new version in place: from the weight group (``path=None``; the version is the one
        the sender announces and must equal `version` when given) or from a safetensors checkpoint
        (then `version` is required). Applies the configured interrupt mode (module docstring)."""
        if path is not None and version is None:
            raise ValueError("update_weights from a checkpoint path needs the version it holds")
        async with self._update_lock:
            t0 = time.monotonic()
            staged = path is None and self.weight_sync == "staged"
            states: list[Received] = []
            if staged:  # receive while generating; pause only to load
                await self._post_receive(version)
                states = await self._received(version)
                while any(s.state == "pending" for s in states):
                    await asyncio.sleep(_STAGING_POLL_S)
                    states = await self._received(version)
                if any(s.state != "ok" for s in states):
                    raise WeightReceiveError(f"receiving version {version} failed: {states}; the loaded "
                                             f"weights are unchanged and generation continues")
                version = _staged_version(states, version)
            if self.config.interrupt == "abort":
                self._abort_epoch += 1
            load = ("checkpoint" if path is not None else self.weight_sync, version, path or "")
            prepared = staged and all(s.version == version and s.prepared for s in states)
            t_pause = time.monotonic()
            if self.config.interrupt in ("keep", "keep_kv") and version is not None:
                loaded = await self._swap_at_once(load, int(version))
            else:
                loaded = await self._swap_in_steps(load, version)
            t_loaded = time.monotonic()
            await self.engine.resume_generation()
            mode = "checkpoint" if path is not None else self.weight_sync
            return UpdateReport(self.version, time.monotonic() - t_pause, t_loaded - t_pause, t_pause - t0,
                                mode, max(r["load_s"] for r in loaded), prepared,
                                max(r["received_bytes"] for r in loaded))

    async def _swap_at_once(self, load: tuple[str, int | None, str], version: int) -> list[dict]:
        """keep / keep_kv with the version known: pause, load, (reset the prefix cache,) relabel,
        sent together and handled by the engine core in this order (module docstring: a paused
        scheduler runs no step that samples); the caller resumes once every answer is in. A failed
        load leaves the engine paused, labelled `version` but running nothing (the next complete
        load relabels it)."""
        core, keep_kv = self.engine.engine_core, self.config.interrupt == "keep_kv"
        if not keep_kv:
            await self.engine.renderer.clear_mm_cache_async()  # pause_generation's client-side part
        pause = core.pause_scheduler_async(mode="keep", clear_cache=not keep_kv)
        if self.engine.vllm_config.max_concurrent_batches > 1:
            # A step dispatched before the pause may still be in the batch queue: its output,
            # processed after a relabel, would carry the new label. The pause is answered once
            # the queue is empty.
            try:
                await pause
            except Exception as e:
                raise WeightUpdateError(f"pausing for version {version} failed: {e}") from e
            calls = []
        else:
            calls = [pause]
        calls.append(self._rpc("load_version", version, *load))
        if not keep_kv:
            calls.append(core.reset_prefix_cache_async(False, False))
        calls.append(core.set_weight_version_async(str(version)))
        # Tasks start in creation order and each sends its message before its first wait, so the
        # engine core receives them in this order on its one input socket.
        results = await asyncio.gather(*(asyncio.ensure_future(c) for c in calls), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0] if isinstance(failed[0], WeightUpdateError) else WeightUpdateError(
                f"the update to version {version} failed; the engine stays paused until a complete "
                f"version is loaded: {failed[0]}") from failed[0]
        loaded = results[-2 if keep_kv else -3]
        self._check_loaded(loaded, version)
        self.version = version
        return loaded

    async def _swap_in_steps(self, load: tuple[str, int | None, str], version: int | None) -> list[dict]:
        """drain / abort (or no version known): pause, load, reset the prefix cache, relabel, one
        call after the other (keep_kv keeps the caches)."""
        keep_kv = self.config.interrupt == "keep_kv"
        if keep_kv:
            await self.engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        else:
            await self.engine.pause_generation(mode=_PAUSE_MODE[self.config.interrupt], clear_cache=True)
        loaded = await self._rpc("load_version", version, *load)
        version = self._check_loaded(loaded, version)
        if not keep_kv:
            await self.engine.reset_prefix_cache()
        await self.engine.update_weight_version(str(version))
        self.version = version
        return loaded

    @staticmethod
    def _check_loaded(loaded: list[dict], version: int | None) -> int:
        """The one version every worker loaded (`version` when given), else `WeightUpdateError`."""
        got = {int(r["version"]) for r in loaded}
        if len(got) != 1 or (version is not None and got != {version}):
            raise WeightUpdateError(f"workers loaded versions {sorted(got)}, expected {version}; "
                                    f"the engine stays paused")
        return got.pop()

    async def _post_receive(self, version: int | None) -> None:
        """Start the staged receive on every worker through their listeners, not between engine
        steps (`pipeline.generator.receive_post`: the trainer's broadcast waits for the post)."""
        from pipeline.generator.receive_post import ReceivePoster

        if self._poster is None:
            self._poster = ReceivePoster(await self._rpc("receive_post_address", version), self.config.weight_timeout_s)
        try:
            await self._poster.post(version)
        except (RuntimeError, TimeoutError) as e:
            raise WeightUpdateError(f"start_receiving of version {version} failed: {e}") from e

    async def _rpc(self, method: str, version: int | None, *args) -> list:
        try:
            return await self.engine.collective_rpc(method, args=args)
        except Exception as e:
            raise WeightUpdateError(f"{method} of version {version} failed; the engine stays paused "
                                    f"until a complete version is loaded: {e}") from e

    async def _received(self, version: int | None) -> list[Received]:
        """Every worker's state of its background receive (`pipeline.protocol.worker_status`)."""
        answers = await self._rpc("received", version)
        try:
            return [received_state(a) for a in answers]
        except MessageError as e:
            raise WeightReceiveError(f"a worker answered the receive poll of version {version} "
                                     f"with no status: {e}") from e

    async def step_gaps(self) -> list[list[float]]:
        """Per worker, the engine's own stall of each update since the last call: seconds between the
        engine steps around its swap (`pipeline.generator.step_clock`; no step in progress counted)."""
        return await self.engine.collective_rpc("step_gaps")

    async def sync_buffer_bytes(self) -> list[dict[str, int]]:
        """Per worker: bytes its streaming buffers allocated so far and hold now."""
        return await self.engine.collective_rpc("sync_buffer_bytes")

    async def expert_layout(self) -> list[dict[str, str]]:
        return await self.engine.collective_rpc("expert_layout")


def _staged_version(states: list[Received], version: int | None) -> int | None:
    """The version every worker staged (all states "ok"), or `version` when they disagree (the load
    then names the disagreement)."""
    staged = {s.version for s in states}
    return staged.pop() if len(staged) == 1 and version in (None, *staged) else version

