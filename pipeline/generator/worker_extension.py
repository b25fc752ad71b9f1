"""vLLM worker extension: receives Hugging Face-named weights and loads them into the engine in place.

Named in vLLM's ``worker_extension_cls`` as ``pipeline.generator.worker_extension.WeightSyncExtension``;
vLLM mixes it into its Worker class inside the (spawned) worker processes, and the driver calls its
methods through ``collective_rpc``. Importing this module imports neither vLLM nor torch at module
level; its side effects are the owner watch (`pipeline.generator.owner_watch`) and the gloo groups'
address (`pipeline.launch.network.bind_gloo_groups`): vLLM imports it in each engine worker before the
worker is built, so that is where the engine's processes learn to end with the process that owns
the engine and where vLLM's groups learn ``cluster.network.address``. Elsewhere (the owner, a process
without an owner, no address set) it does nothing.

Its methods: the weight group and the receive paths (`WeightReceiveMixin`,
`pipeline.generator.weight_receive`, with their invariants), the in-place load they end in
(`WeightLoadMixin`, `pipeline.generator.weight_load`), and here the worker's status and routing
services: the check for tensors left on the meta device and Keep Routing's capture
(`pipeline.generator.routing_capture`).
"""
from __future__ import annotations

from pipeline.generator.interrupted_reload import tensors_without_data
from pipeline.generator.owner_watch import ignore_stop_signals, watch_owner
from pipeline.generator.weight_receive import WeightReceiveMixin
from pipeline.launch.network import bind_gloo_groups


class WeightSyncExtension(WeightReceiveMixin):
    """Methods vLLM mixes into its Worker (``self.model_runner``, ``self.rank`` come from the Worker)."""

    def tensors_without_data(self) -> list[str]:
        """Names of the model's parameters and buffers on the meta device (empty unless a load broke it)."""
        return tensors_without_data(self.model_runner.get_model())

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
