"""The generator driver: vLLM's AsyncLLM turned into a source of `RolloutSample`s with exact versions.

Invariants:
- Input is prompt token ids; nothing is tokenized here. Each sample of a group is its own request
  (n=1) seeded by `request_seed(run seed, group, sample, attempt, segment)`; the samples of a group
  share the prompt's KV blocks through vLLM's prefix cache.
- Every completion token carries the behaviour logprob of the sampled token (``logprobs=0``, in the
  configured logprobs mode) and the policy version that sampled it. Versions come from vLLM's own
  per-output weight-version labels: the driver sets the label only while generation is paused, so a
  token's label is exactly the weights that produced it. EOS (or a stop token id) is kept with its
  logprob.
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
- With an `EpisodeRunner` (a task with an environment) a sample or an evaluation answer is a whole
  multi-turn episode (`pipeline.generator.episodes`): each turn is a `complete` call on the same
  token sequence, so everything above holds per model turn.
- Engine processes are spawned: code that builds a `Generator` must run under ``__main__`` guards.
- A signal to the whole process group (``kill -TERM -PID``, ``scancel``, ``tokenflow cancel``)
  never ends a worker on its own: workers ignore the stop signals
  (`pipeline.generator.owner_watch.ignore_stop_signals`); the owner decides (a departure's
  `Leave` first) and `shutdown` ends the engine at once: vLLM's client stands down, then EngineCore
  and its workers get SIGKILL (EngineCore may have begun its own orderly shutdown on the signal
  meanwhile: it exits its loop first, so it steps no more). Before, a departure's worker ended on
  the signal while its EngineCore, still stepping, logged a fatal ``AssertionError: collective_rpc
  should not be called on follower node``, and vLLM's graceful shutdown took 5 s more. An owner
  that dies ends them through the owner watch (`pipeline.generator.owner_watch`).
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from pipeline.generator.capture import kept_token_ids
from pipeline.generator.completion import Completion, EpisodeRunning, rollout_sample
from pipeline.generator.config import GeneratorConfig, GroupRequest, request_seed
from pipeline.generator.engine_plan import EnginePlan, engine_plan
from pipeline.generator.vllm_args import (engine_args, engine_process_env, resolve_weight_sync, sampled_logprobs,
                                          sampling_params)
from pipeline.protocol.codec import MessageError
from pipeline.protocol.record import RecordSchema, RolloutSample
from pipeline.protocol.worker_status import Received, received_state

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


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


class Generator:
    """Drives one vLLM AsyncLLM engine; all methods run on one asyncio loop."""

    def __init__(self, config: GeneratorConfig, generator_id: int = 0, initial_version: int = 0,
                 schema: RecordSchema | None = None, episodes: EpisodeRunning | None = None):
        self.config = config
        self.episodes = episodes  # multi-turn episodes instead of single completions (tasks with an environment)
        self.generator_id = generator_id
        self.version = initial_version
        self.schema = schema or RecordSchema()
        self.engine: AsyncLLM | None = None
        self._update_lock = asyncio.Lock()
        self._poster = None  # posts staged receives past the engine's steps (receive_post.py), made at first use
        self._abort_epoch = 0  # bumped before every abort-mode pause
        self._ids = itertools.count()
        self.routing_shape: tuple[int, int] | None = None  # (MoE layers, top_k) with record_routing
        self.start_s = 0.0
        self.weight_sync = resolve_weight_sync(config)
        self.plan: EnginePlan | None = None  # runner, compilation, routing capture: set by `start`
        self._engine_pids: list[int] = []  # processes the engine started (ended by `shutdown`)

    async def start(self) -> "Generator":
        from vllm.v1.engine.async_llm import AsyncLLM

        from pipeline.generator.owner_watch import mark_owner
        from pipeline.supervise import descendants, is_resource_tracker

        t0 = time.monotonic()
        self.plan = engine_plan(self.config)
        before = set(descendants(os.getpid()))
        mark_owner()  # the engine's processes end when this one dies, SIGKILL included
        args = engine_args(self.config)
        vllm_config = args.create_engine_config()
        with engine_process_env(vllm_config):
            self.engine = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=args.disable_log_stats)
        self._engine_pids = [p for p in descendants(os.getpid())  # the tracker ends with this process
                             if p not in before and not is_resource_tracker(p)]
        await self.engine.update_weight_version(str(self.version))
        if self.plan.routing_capture != "off":
            await self._start_routing_capture()
        self.start_s = time.monotonic() - t0
        return self

    async def _start_routing_capture(self) -> None:
        """Install the routing capture of `plan` and prove it on a probe request: every position the
        engine ran must have its routing, else the generator refuses to start (naming the plan)."""
        if self.plan.routing_capture == "hook":
            self.routing_shape = tuple((await self.engine.collective_rpc("start_routing_capture"))[0])
        else:
            model = self.engine.model_config
            self.routing_shape = (model.get_total_num_hidden_layers(), model.get_num_experts_per_tok())
        if self.schema.routed_experts not in (None, self.routing_shape):
            raise ValueError(f"the engine routes {self.routing_shape} (MoE layers, top_k), the run's "
                             f"record schema expects {self.schema.routed_experts}")
        probe = [1, 2, 3, 4]
        out, routed = await self._run(probe, sampling_params(self.config, 0, 2, greedy=True))
        missing = np.flatnonzero((routed < 0).any(axis=(1, 2)))
        if len(missing):
            raise RuntimeError(f"routing capture ({self.plan.routing_capture}, {self.plan.runner} runner, "
                               f"{self.plan.compilation}) recorded no routing for positions {missing.tolist()} "
                               f"of a {len(probe) + len(out.token_ids) - 1}-position probe request; refusing "
                               "to start (set generator.enforce_eager=true to run the hook uncompiled)")

    def engine_alive(self) -> bool:
        """False once a process the engine started has died (vLLM itself may notice much later)."""
        from pipeline.supervise import alive

        return all(alive(p) for p in self._engine_pids)

    def shutdown(self) -> None:
        """End the engine and every process it started, at once: vLLM's client stands down first
        (so it takes the engine's end for no failure), then its processes get SIGKILL (nothing in
        them needs a graceful end; its workers ignore SIGTERM)."""
        from pipeline.supervise import end_processes

        if self._poster is not None:
            self._poster.close()
            self._poster = None
        if self.engine is not None:
            self.engine.shutdown(timeout=0)
            self.engine = None
        end_processes(self._engine_pids, grace_s=0)
        self._engine_pids = []

    # -- generation ---------------------------------------------------------------------------
    async def _run(self, prompt_ids: Sequence[int], params) -> tuple[Any, np.ndarray | None]:
        """The request's CompletionOutput and (``record_routing``) its routing."""
        rid = f"r{next(self._ids)}"
        final = None
        prompt: dict[str, Any] = {"prompt_token_ids": [int(t) for t in prompt_ids]}
        if self.config.interrupt == "keep_kv":
            prompt["cache_salt"] = f"v{self.version}"
        async for out in self.engine.generate(prompt, params, rid):
            final = out
        out = final.outputs[0]
        if self.routing_shape is None:
            return out, None
        positions = len(prompt_ids) + len(out.token_ids) - 1
        if self.plan.routing_capture == "vllm":  # [positions the engine ran, layers, top_k]
            routed = np.full((positions, *self.routing_shape), -1, dtype=np.int16)
            got = out.routed_experts if out.routed_experts is not None else routed[:0]
            routed[:min(positions, len(got))] = got[:positions]
            return out, routed
        raw = await self.engine.collective_rpc("take_routing", args=(rid, positions))
        return out, np.frombuffer(raw[0], dtype=np.int16).reshape(positions, *self.routing_shape)

    async def complete(self, prompt_ids: Sequence[int], seed_of_segment, max_tokens: int | None = None,
                       greedy: bool = False, temperature: float | None = None) -> Completion:
        """Generate one completion, resuming it as a prefix after each abort-mode weight update.

        ``seed_of_segment(k)`` gives the sampling seed of the k-th segment (0 before any abort);
        ``temperature``: an evaluation sample's (`sampling_params`), no sampling mask recorded."""
        budget = self.config.max_tokens if max_tokens is None else max_tokens
        done = Completion([], [], [], "length")
        for segment in itertools.count():
            epoch = self._abort_epoch
            params = sampling_params(self.config, seed_of_segment(segment), budget - len(done.token_ids), greedy,
                                     temperature)
            out, done.routed_experts = await self._run(list(prompt_ids) + done.token_ids, params)
            done.token_ids += out.token_ids
            done.logprobs += sampled_logprobs(out)
            done.versions += _token_versions(out)
            if self.config.sampling_mask_width and not greedy and temperature is None:
                done.sampling_mask = (done.sampling_mask or []) + [
                    kept_token_ids(out, self.config.sampling_mask_width)]
            done.finish_reason = out.finish_reason
            resumable = (out.finish_reason == "abort" and epoch != self._abort_epoch
                         and len(done.token_ids) < budget)
            if not resumable:
                if out.finish_reason == "abort" and len(done.token_ids) == budget:
                    done.finish_reason = "length"
                return done

    async def episode_or_completion(self, prompt_ids: Sequence[int], seed_of_segment, max_tokens: int | None = None,
                                    greedy: bool = False) -> Completion:
        """An episode (with `episodes`: `pipeline.generator.episodes`) or one completion."""
        if self.episodes is None:
            return await self.complete(prompt_ids, seed_of_segment, max_tokens, greedy)
        budget = self.config.max_tokens if max_tokens is None else max_tokens
        return await self.episodes.run(self, prompt_ids, seed_of_segment, budget, greedy)

    async def generate_sample(self, request: GroupRequest, sample_index: int) -> RolloutSample:
        t_start = time.time()
        c = await self.episode_or_completion(request.prompt_ids, lambda seg: request_seed(
            self.config.seed, request.group_id, sample_index, request.attempt, seg))
        if not c.token_ids:
            raise RuntimeError(f"group {request.group_id} sample {sample_index} ended with no tokens "
                               f"({c.finish_reason})")
        return rollout_sample(c, request, sample_index, self.generator_id, self.schema, t_start, time.time(),
                              self._record_routing(request, c))

    def _record_routing(self, request: GroupRequest, c: Completion) -> dict[str, np.ndarray]:
        """The record's routing fields (`pipeline.protocol.record`): prompt rows, completion rows with the
        never-fed last token's row -1. A position the engine never computed fails the sample."""
        if self.schema.routed_experts is None:
            return {}
        routed, p = c.routed_experts, len(request.prompt_ids)
        if routed.min() < 0:
            missing = np.flatnonzero((routed < 0).any(axis=(1, 2)))
            raise RuntimeError(f"group {request.group_id}: the engine never routed positions "
                               f"{missing[:8].tolist()} (prefix cache?); no routing to record")
        last = np.full((1, *routed.shape[1:]), -1, dtype=np.int16)
        return {"prompt_routed_experts": routed[:p], "routed_experts": np.concatenate([routed[p:], last])}

    async def generate_group(self, request: GroupRequest) -> list[RolloutSample]:
        """The group's ``n`` samples, in sample order."""
        return list(await asyncio.gather(*(self.generate_sample(request, i) for i in range(request.n))))

    async def evaluate(self, prompts: Sequence[Sequence[int]], max_tokens: int | None = None) -> list[Completion]:
        """Greedy completions of `prompts` for evaluation (not rollouts), with per-token versions:
        an update during an evaluation shows in them like in any request."""
        return list(await asyncio.gather(*(self.episode_or_completion(p, lambda seg: None, max_tokens, greedy=True)
                                           for p in prompts)))

    async def evaluate_sampled(self, prompt_ids: Sequence[int], samples: int, temperature: float, seed_of_sample,
                               max_tokens: int | None = None) -> list[Completion]:
        """`samples` completions of one held-out prompt at `temperature` (pass@k; single-turn tasks);
        ``seed_of_sample(j, segment)`` seeds the j-th."""
        return list(await asyncio.gather(*(
            self.complete(prompt_ids, lambda seg, j=j: seed_of_sample(j, seg), max_tokens, temperature=temperature)
            for j in range(samples))))

    # -- weights ------------------------------------------------------------------------------
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


def _token_versions(output: Any) -> list[int]:
    """Per-token versions from vLLM's weight-version spans of a finished CompletionOutput."""
    n = len(output.token_ids)
    spans = output.weight_versions
    if n and not spans:
        raise RuntimeError("the engine labelled no weight version on a finished request")
    if spans and (spans[0].start != 0 or spans[-1].end != n):
        raise RuntimeError(f"weight-version spans {spans} do not cover the {n} tokens")
    if len(spans or ()) == 1:
        return [int(spans[0].version)] * n
    versions: list[int] = []
    for span in spans or ():
        versions += [int(span.version)] * (span.end - span.start)
    return versions
