"""The weight group and the receive paths of a vLLM engine worker: streamed, staged, and the driver's load.

`WeightReceiveMixin` is mixed into vLLM's Worker as part of
`pipeline.generator.worker_extension.WeightSyncExtension` (``self.rank``, ``self.device`` come from the Worker);
it loads what it receives through `WeightLoadMixin` (`pipeline.generator.weight_load`). Imports neither
vLLM nor torch at module level.

Invariants:
- Streamed receive (`receive_weights`): each bucket is loaded as it arrives, in two bucket buffers
  (`sync_buffer_bytes` reports them). The channel reuses bucket k-1's buffer as soon as bucket k is
  asked for, while vLLM's layerwise reload keeps a module's tensors until the module is complete;
  so before each reuse, the tensors the reload still holds in that buffer are copied
  (`pipeline.generator.held_views`; their bytes are reported as ``carried``). Plans keep a fused
  module (q/k/v, gate/up) in one bucket where it fits, so there is usually nothing to copy.
- A load that fails half-way leaves the modules that completed at the new version and all others
  at the old one (`pipeline.generator.weight_load`; the driver keeps the engine paused until a
  complete version is loaded); the next load, staged or streamed, starts from a clean model. The
  first load after a failed one also checks that no parameter or buffer is on meta
  (`load_version`) and fails otherwise, so the engine stays paused instead of stepping into a
  missing tensor.
- Staged receive (`start_receiving` / `received` / `load_received`; the driver calls the first
  through the worker's receive-post listener, `receive_post_address`, so the trainer's broadcast
  does not wait for the engine step in progress): a background thread receives
  the whole update into memory while the engine generates and then builds its kernel form beside
  the live model (`pipeline.generator.kernel_swap`), so the pause only swaps references; where that
  does not apply (GPU, adapters, unknown kernels) the pause loads it in place. A staged
  update that cannot be built (an MoE layer lacks experts) fails its receive: nothing changed.
- `load_version` marks each swap on a `StepClock` (`pipeline.generator.step_clock`): `step_gaps`
  returns the engine's own stall per update, the gap between the steps around it.
- A worker's rank in the weight group is ``first_rank + its vLLM rank`` (TP workers each receive
  the full HF tensors and keep their shard).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.generator.expert_writer import non_expert
from pipeline.generator.interrupted_reload import tensors_without_data
from pipeline.generator.weight_load import WeightLoadMixin

if TYPE_CHECKING:
    import torch


class WeightReceiveMixin(WeightLoadMixin):
    """The weight group's receiving end in a vLLM Worker, loading what it receives in place."""

    _tf_load_failed = False  # the last `load_version` raised: the next one checks for meta tensors
    _tf_received_bytes = 0  # bytes the channel counted receiving the update loaded last (0: from a checkpoint)

    def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int,
                          timeout_s: float, secret: bytes, backend: str = "gloo", epoch: int = 0, senders: int = 1,
                          channel: str = "broadcast") -> int:
        """Join the trainer's weight group as rank ``first_rank + self.rank``; returns that rank.
        ``channel``: 'broadcast' (`TorchDistChannel`) or 'cuda_ipc' (`CudaIpcChannel`, same GPU);
        ``secret``: the run's (signs the group's store)."""
        self.leave_weight_group()
        rank = first_rank + int(self.rank)
        self._step_clock()
        self._tf_channel = _open_channel(host, port, rank, world_size, timeout_s, backend, epoch, senders, channel,
                                         self.device, secret)
        return rank

    def start_joining_weight_group(self, host: str, port: int, first_rank: int, world_size: int,
                                   timeout_s: float, secret: bytes, backend: str = "gloo", epoch: int = 0,
                                   senders: int = 1, channel: str = "broadcast") -> int:
        """Start joining weight group ``epoch`` on a background thread (`GroupBuild`), staying in the
        group in use until `use_weight_group` switches; returns this worker's rank in it."""
        from pipeline.weights.group_build import GroupBuild

        rank = first_rank + int(self.rank)
        joins = self.__dict__.setdefault("_tf_joins", {})
        if epoch in joins:
            joins.pop(epoch).abandon()
        device = self.device  # this worker's GPU, read on its own thread (vLLM sets it per thread)
        joins[epoch] = GroupBuild(epoch, None, lambda: _open_channel(host, port, rank, world_size, timeout_s,
                                                                      backend, epoch, senders, channel, device,
                                                                      secret))
        self._tf_join_timeout = timeout_s
        return rank

    def use_weight_group(self, epoch: int) -> None:
        """Switch to group ``epoch`` (started by `start_joining_weight_group`; waits for it to form,
        at most its timeout): the group in use is closed, joins of older groups are given up."""
        from pipeline.weights.group_build import take_joined

        joins = self.__dict__.get("_tf_joins", {})
        if epoch not in joins:
            raise RuntimeError(f"weight group epoch {epoch} was never joined")
        channel, _ = take_joined(joins, epoch, self._tf_join_timeout + 5)
        self.leave_weight_group()
        self._tf_channel = channel

    def _channel(self):
        channel = getattr(self, "_tf_channel", None)
        if channel is None:
            raise RuntimeError("no weight group: call join_weight_group first")
        return channel

    def receive_weights(self) -> int:
        """Streamed: receive the next update and load each bucket as it arrives (two bucket
        buffers of memory, plus copies of what the reload holds of a buffer being reused);
        returns its version."""
        from pipeline.generator.held_views import copy_held_views

        channel = self._channel()
        before = channel.wire.reading()
        update = channel.receive(stage=False, release=copy_held_views)
        try:
            self.load_hf_weights(update)
        finally:
            self._tf_carried = update.carried
            self._tf_received_bytes = channel.wire.since(before).received
        return update.version

    def sync_buffer_bytes(self) -> dict[str, int]:
        """Bytes of this worker's streaming buffers: allocated so far and held now; ``carried``:
        bytes the last streamed receive copied out of a buffer being reused; ``experts_held``: the
        most expert bytes the last in-place load assembled at once (CPU MoE kernels)."""
        buffers = self._channel().buffers
        return {"allocated": buffers.allocated, "resident": buffers.resident,
                "carried": getattr(self, "_tf_carried", 0), "experts_held": getattr(self, "_tf_experts_held", 0)}

    def start_receiving(self) -> None:
        """Staged: receive the next update into host memory on a background thread while the
        engine keeps generating, then build its kernel form there (`_prepare`); `load_received`
        then applies it."""
        import threading

        channel = self._channel()
        if getattr(self, "_tf_staging", None) is not None:
            raise RuntimeError("an update is already being received")
        result: dict[str, Any] = {}

        def receive() -> None:
            try:
                before = channel.wire.reading()
                update = channel.receive(stage=True)
                tensors = list(update)  # views that keep their buckets alive
                result["received_bytes"] = channel.wire.since(before).received
                result["prepared"] = self._prepare(tensors)
                if result["prepared"] is None:
                    result["tensors"] = tensors
                result["version"] = update.version
            except BaseException as e:  # handed to load_received, which raises it
                result["error"] = e

        thread = threading.Thread(target=receive, name="tokenflow-weight-receive", daemon=True)
        thread.start()
        self._tf_staging = (thread, result)

    def receive_post_address(self) -> str:
        """Address of this worker's receive-post listener, started at the first call: the driver
        starts staged receives through it without waiting for an engine step
        (`pipeline.generator.receive_post`)."""
        if getattr(self, "_tf_post", None) is None:
            from pipeline.generator.receive_post import ReceivePostListener

            self._tf_post = ReceivePostListener(self.start_receiving)
        return self._tf_post.address

    def _prepare(self, tensors: list[tuple[str, "torch.Tensor"]]):
        """The update's kernel form (`kernel_swap.prepare`), or None where the pause must load it in place."""
        from pipeline.generator.kernel_swap import prepare
        from pipeline.weights.adapters import is_adapter_update

        if not tensors or is_adapter_update(tensors[0][0]):
            return None
        writers = self._expert_writers()
        return prepare(self.model_runner.get_model(), non_expert(tensors, writers), writers)

    def received(self) -> tuple[str, dict]:
        """State of the background receive, a `pipeline.protocol.worker_status.Received` record's
        plain form: pending, ok (version, prepared or in place) or failed (the failed update is then
        dropped, leaving the loaded weights untouched)."""
        from pipeline.protocol.worker_status import Received

        staging = getattr(self, "_tf_staging", None)
        if staging is None:
            raise RuntimeError("received called without start_receiving")
        thread, result = staging
        if thread.is_alive():
            return Received("pending").plain()
        if "error" in result:
            self._tf_staging = None
            return Received("failed", error=str(result["error"])).plain()
        return Received("ok", int(result["version"]), prepared=result["prepared"] is not None).plain()

    def load_received(self) -> int:
        """Swap in (or, not prepared, load) the update `start_receiving` received; returns its
        version (raises its error)."""
        staging = getattr(self, "_tf_staging", None)
        if staging is None:
            raise RuntimeError("load_received called without start_receiving")
        thread, result = staging
        thread.join(self._channel().timeout.total_seconds())
        if thread.is_alive():
            raise TimeoutError("the background weight receive did not finish within the channel timeout")
        self._tf_staging = None
        if "error" in result:
            raise result["error"]
        self._tf_received_bytes = result["received_bytes"]
        if result["prepared"] is None:
            self.load_hf_weights(result["tensors"])
        else:
            result["prepared"].swap()
        return result["version"]

    def load_version(self, source: str, version: int | None, path: str = "") -> dict[str, Any]:
        """The driver's load inside a pause: ``source`` 'staged' (`load_received`), 'streamed'
        (`receive_weights`) or 'checkpoint' (`path`, holding `version`); returns the version
        loaded, this worker's seconds loading it (``load_s``) and the bytes its channel counted
        receiving it (``received_bytes``; 0 from a checkpoint). Raises if the load failed, or if
        the load following a failed one left a tensor on the meta device."""
        import time

        t0 = time.perf_counter()
        complete = False
        self._tf_received_bytes = 0
        try:
            if source == "checkpoint":
                self.load_weights_from_safetensors(path)
            else:
                version = self.load_received() if source == "staged" else self.receive_weights()
            # after a failed load only: the scan costs about a millisecond on a 28-layer model
            missing = tensors_without_data(self.model_runner.get_model()) if self._tf_load_failed else []
            if missing:
                raise RuntimeError(f"after loading version {version}, {len(missing)} tensors have no data "
                                   f"(meta device), e.g. {missing[:4]}; the engine must not run a step")
            complete = True
        finally:
            self._tf_load_failed = not complete
            self._step_clock().swapped()
        return {"version": version, "load_s": time.perf_counter() - t0, "received_bytes": self._tf_received_bytes}

    def _step_clock(self):
        if getattr(self, "_tf_clock", None) is None:
            from pipeline.generator.step_clock import StepClock

            self._tf_clock = StepClock(self)
        return self._tf_clock

    def step_gaps(self) -> list[float]:
        """The engine's stall of each update since the last call: seconds between the end of the
        last engine step before its swap and the start of the first after it (`StepClock`)."""
        return self._step_clock().take()

    def leave_weight_group(self) -> None:
        channel = getattr(self, "_tf_channel", None)
        if channel is not None:
            channel.close()
            self._tf_channel = None


def _open_channel(host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str, epoch: int,
                  senders: int, channel: str, device, secret: bytes):
    """This worker's end of a weight group on ``device`` (the worker's own): 'broadcast'
    (`TorchDistChannel`) or 'cuda_ipc'; ``secret``: the run's (signs the group's store)."""
    if channel == "cuda_ipc":
        from pipeline.weights.cuda_ipc import CudaIpcChannel

        return CudaIpcChannel(host, port, rank, world_size, timeout_s, epoch, senders, device, secret=secret)
    from pipeline.weights.group import TorchDistChannel

    return TorchDistChannel(host, port, rank, world_size, timeout_s, backend, epoch, senders, device, secret=secret)
