"""Keep Routing in the generator on vLLM's V1 model runner: record the experts the MoE routers
choose, per request (on V2, vLLM's own routed-experts output does it: engine_plan.py).

Runs inside a vLLM worker (installed by the worker extension's ``start_routing_capture``). vLLM
0.32's routers (``BaseRouter._select_experts``) call a capture hook with each step's top-k ids
(logical ids, before any EPLB remapping); vLLM's own consumer of that hook is wired only into the V2
runner, so this module attributes the rows itself: during a forward, the V1 runner's input batch
holds the requests in token order (``input_batch.req_ids``), their token spans
(``query_start_loc``) and each token's position (``positions``).

Compiled engines: the hook calls the custom op ``tokenflow::record_routing``, which Dynamo keeps in
the graph as an opaque call (it mutates the recorder's row counter), so compiled steps run it like
eager ones. Dynamo traced the model at start-up, before the hook existed, so the recorder has it
traced again once installed (vLLM's ``reset_compile_wrapper``, then the runner's warm-up); the
engine's compile cache is off for such engines (vllm_args.py), so the hookless graph never comes back.

Invariants:
- ``routes[request]`` is ``[positions, moe_layers, top_k]`` int16 global expert ids, position p =
  the p-th token of prompt + completion; the last sampled token is never run through the model
  and has no row.
- Last computation wins: a position computed again (a ``keep``-mode weight update drops the KV and
  recomputes the prefix on the new weights; preemption recomputes too) is overwritten, so the
  routing recorded for every token is the one of the forward whose KV the later tokens attended
  to. An ``abort``-mode resumed segment is a new request that recomputes its whole prefix.
- Positions served from the prefix cache are never computed by the request, so this capture runs
  with prefix caching off (engine_plan.py); a position never computed reads as -1 when taken.
- ``rows_recorded[layer]`` counts the router rows each layer's hook saw: the op's one effect a
  graph can see, which keeps it from being dropped as dead code. Whether every position got its
  routing is checked by the driver on a probe request at start (`Generator.start`).
- Routing is replicated over tensor-parallel workers (each computes the full router logits); the
  driver reads worker 0's copy and every worker drops its own.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

_RECORDERS: dict[int, "RoutingRecorder"] = {}  # by id: the op reaches its recorder from compiled code


@torch.library.custom_op("tokenflow::record_routing", mutates_args=("rows_recorded",))
def record_routing(topk_ids: torch.Tensor, layer: int, recorder: int, rows_recorded: torch.Tensor) -> None:
    """Hand one MoE layer's ``[rows, top_k]`` expert ids of this forward to recorder `recorder`."""
    _RECORDERS[recorder].capture(layer, topk_ids)
    rows_recorded[layer] += topk_ids.shape[0]


@record_routing.register_fake
def _(topk_ids, layer, recorder, rows_recorded) -> None:
    return None


class RoutingRecorder:
    """Per-request routing of one worker (see the module invariants)."""

    def __init__(self, model_runner: Any):
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        if not hasattr(model_runner, "input_batch"):
            raise RuntimeError(f"the routing hook reads vLLM's V1 model runner; this engine runs "
                               f"{type(model_runner).__module__} (V2 returns routing itself: engine_plan.py)")
        self.runner = model_runner
        routers: dict[int, tuple[int, Any]] = {}  # a layer and its runner may both hold the router
        for m in model_runner.get_model().modules():
            router = getattr(m, "router", None)
            if isinstance(router, BaseRouter) and hasattr(m, "layer_id"):
                routers.setdefault(id(router), (int(m.layer_id), router))
        if not routers:
            raise ValueError("routing capture needs an MoE model; this engine has no MoE routers")
        ordered = [r for _, r in sorted(routers.values(), key=lambda lr: lr[0])]
        self.num_layers = len(ordered)
        self.top_k = int(ordered[0].top_k)
        self.routes: dict[str, np.ndarray] = {}
        self._batch: list[tuple[str, np.ndarray, int, int]] = []
        self.rows_recorded = torch.zeros(self.num_layers, dtype=torch.int64)
        _RECORDERS[id(self)] = self
        for index, router in enumerate(ordered):
            router.set_capture_fn(partial(torch.ops.tokenflow.record_routing, layer=index, recorder=id(self),
                                          rows_recorded=self.rows_recorded))
        self._trace_again()

    def _trace_again(self) -> None:
        """A compiled model traced before the hook existed: drop its graph and warm up again."""
        from vllm.compilation.wrapper import reset_compile_wrapper
        from vllm.config import CompilationMode, set_current_vllm_config

        config = self.runner.vllm_config
        if config.compilation_config.mode == CompilationMode.NONE:
            return
        with set_current_vllm_config(config):
            reset_compile_wrapper(self.runner.get_model())
            self.runner.warming_up_model()

    def _step_layout(self, rows: int) -> list[tuple[str, np.ndarray, int, int]]:
        """(request id, positions, first row, end row) of each request in this forward."""
        batch = self.runner.input_batch
        n = batch.num_reqs
        starts = self.runner.query_start_loc.np[:n + 1]
        tokens = int(starts[-1])
        if rows < tokens:
            raise RuntimeError(f"routing capture saw {rows} rows for a batch of {tokens} tokens "
                               "(sequence-parallel MoE is not supported)")
        positions = self.runner.positions[:tokens].cpu().numpy()
        return [(rid, positions[starts[i]:starts[i + 1]], int(starts[i]), int(starts[i + 1]))
                for i, rid in enumerate(batch.req_ids[:n])]

    def capture(self, layer: int, topk_ids) -> None:
        """Store one layer's rows of this forward under each request's positions."""
        if layer == 0:
            self._batch = self._step_layout(topk_ids.shape[0])
        ids = topk_ids.cpu().numpy()
        for rid, pos, a, b in self._batch:
            if b == a:
                continue
            arr = self.routes.get(rid)
            need = int(pos.max()) + 1
            if arr is None or len(arr) < need:
                grown = np.full((max(need, 2 * len(arr) if arr is not None else need), self.num_layers,
                                 self.top_k), -1, dtype=np.int16)
                if arr is not None:
                    grown[:len(arr)] = arr
                self.routes[rid] = arr = grown
            arr[pos, layer] = ids[a:b]

    def take(self, external_id: str, positions: int) -> bytes:
        """The routing of the request vLLM knows as ``external_id`` + suffix, ``positions`` rows,
        as raw bytes of ``[positions, layers, top_k]`` int16 (-1: never computed); forgets it."""
        matches = [rid for rid in self.routes if rid == external_id or rid.startswith(external_id + "-")]
        if len(matches) > 1:
            raise RuntimeError(f"request id {external_id!r} matches {matches}")
        out = np.full((positions, self.num_layers, self.top_k), -1, dtype=np.int16)
        if matches:
            arr = self.routes.pop(matches[0])
            n = min(positions, len(arr))
            out[:n] = arr[:n]
        return out.tobytes()
