"""Keep Routing in the trainer: replay the experts the generator routed each token to.

A sample's routing is ``routed_experts``: int array ``[P + C - 1, layers, top_k]`` of GLOBAL expert
ids for every position the trainer feeds the model (the prompt and every completion token but the
last, i.e. ``tokens[:-1]``), MoE layers in model order. The replay goes through megatron-core's
own mechanism (``RouterReplay``, ``transformer/moe/router_replay.py``): each router gets a replay
instance and, for a forward, the target indices; the router then gathers its scores at those
experts instead of taking its own top-k, so the gate weights still get gradients and the expert
mixture weights are the trainer's (softmax over the replayed experts' logits, as the model's
router computes them), only the choice is the generator's.

Invariants:
- Only the policy model replays: instances are attached to its routers here (a reference model
  built alongside gets none), and removed from megatron's process-global instance list so other
  models in the process never see them.
- Token order is megatron's: the router flattens ``[S, B]`` sequence-first, so the indices of
  layer l are ``routed[:, :, l].transpose(0, 1).reshape(S * B, k)``; with sequence parallelism
  each tensor-parallel rank routes the contiguous slice ``S / tp * r ... S / tp * (r + 1)`` of the
  sequence and gets that slice. Expert parallelism needs nothing: routing precedes dispatch and
  uses global ids.
- A micro-batch replays only if every real row carries routing; positions that are padding
  replay experts ``0..k-1`` (their outputs are masked out of the loss). Otherwise the model
  routes by itself, which `replay` reports by returning False.
- ``moe_router_fusion`` bypasses replay in megatron-core 0.16.1 and is refused.
- No activation recomputation runs in this trainer, so backward never re-routes and forward
  replay is enough; indices are cleared after each forward.

Worked example: 2 rows of width S = 3, 1 layer, k = 2; row 0 routes its positions to
[[0,1],[2,3],[1,3]], row 1 (a padding-only dummy) gets [[0,1]]*3; the layer's target is rows
s-major: [[0,1],[0,1], [2,3],[0,1], [1,3],[0,1]] (6 = S*B tokens). With SP over tp = 3, rank 1
gets tokens 2 and 3 only: [[2,3],[0,1]].
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import numpy as np
import torch


def moe_routers(model) -> list:
    """The MoE routers of ``model`` (a megatron GPTModel, possibly DDP-wrapped), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def enable_routing_replay(model) -> int:
    """Attach a replay instance to every router of ``model``; returns the number of MoE layers."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    routers = moe_routers(model)
    if not routers:
        raise ValueError("trainer.routing_replay needs an MoE model; this model has no routers")
    for router in routers:
        if router.config.moe_router_fusion:
            raise ValueError("moe_router_fusion bypasses routing replay in megatron-core 0.16.1")
        if router.router_replay is None:
            router.router_replay = RouterReplay()
            RouterReplay.global_router_replay_instances.remove(router.router_replay)
    return len(routers)


def attach_routing(micro_batches: Sequence, samples: Sequence, device) -> list:
    """Set ``extras['routed_experts']`` ([rows, S, layers, k] int64) on micro-batches whose real
    rows all carry routing (module invariants)."""
    for mb in micro_batches:
        routed = [samples[i].routed_experts for i in mb.sample_index if i >= 0]
        if not routed or any(r is None for r in routed):
            continue
        rows, length = mb.input_ids.shape
        layers, k = routed[0].shape[1:]
        out = np.broadcast_to(np.arange(k), (rows, length, layers, k)).copy()
        for row, i in enumerate(mb.sample_index):
            if i >= 0:
                r = samples[i].routed_experts
                n = len(samples[i].prompt_ids) + len(samples[i].completion_ids) - 1
                if r.shape != (n, layers, k):
                    raise ValueError(f"sample {i}: routed_experts has shape {r.shape}, expected "
                                     f"({n}, {layers}, {k}) (prompt + completion - 1 positions)")
                out[row, :n] = r
        mb.extras["routed_experts"] = torch.from_numpy(out).to(device)
    return list(micro_batches)


def layer_targets(routed: torch.Tensor, tp_rank: int = 0, tp_size: int = 1,
                  sequence_parallel: bool = False) -> list[torch.Tensor]:
    """Per-layer ``[tokens, k]`` targets in the router's token order for this rank."""
    rows, length = routed.shape[:2]
    if sequence_parallel:
        if length % tp_size:
            raise ValueError(f"sequence length {length} is not divisible by tp={tp_size}")
        part = length // tp_size
        routed = routed[:, tp_rank * part:(tp_rank + 1) * part]
    s_major = routed.transpose(0, 1)  # [S, B, layers, k]
    return [s_major[:, :, l].reshape(-1, routed.shape[-1]) for l in range(routed.shape[2])]


@contextmanager
def replay(model, routed: torch.Tensor | None, tp_rank: int = 0, tp_size: int = 1,
           sequence_parallel: bool = False):
    """Within the block, ``model``'s routers replay ``routed`` ([rows, S, layers, k]); yields
    whether replay is active (False: ``routed`` is None, the model routes by itself)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if routed is None:
        yield False
        return
    routers = moe_routers(model)
    targets = layer_targets(routed, tp_rank, tp_size, sequence_parallel)
    if len(targets) != len(routers):
        raise ValueError(f"routing has {len(targets)} layers, the model {len(routers)} MoE layers")
    for router, target in zip(routers, targets):
        if router.router_replay is None:
            raise ValueError("routing given but replay is off: set trainer.routing_replay=true")
        router.router_replay.set_target_indices(target)
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield True
    finally:
        for router in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
