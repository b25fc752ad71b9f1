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
- Samples carry routing whenever the generator records it (``generator.record_routing``);
  ``trainer.routing_replay`` decides whether it is replayed or only compared with.
- Only the policy model replays: instances are attached to its routers here (a reference model
  built alongside gets none), and removed from megatron's process-global instance list so other
  models in the process never see them.
- Token order is megatron's: the router flattens ``[S, B]`` sequence-first, so the indices of
  layer l are ``routed[:, :, l].transpose(0, 1).reshape(S * B, k)``; with sequence parallelism
  each tensor-parallel rank routes the contiguous slice ``S / tp * r ... S / tp * (r + 1)`` of the
  sequence and gets that slice. Expert parallelism needs nothing: routing precedes dispatch and
  uses global ids.
- Samples sit where the batch layout placed them (``rows``/``offsets``: one row per sample when
  padded, several samples in one row when packed; `pipeline.trainer.layout`).
- A micro-batch replays only if every real sample carries routing; positions that are padding
  replay experts ``0..k-1`` (their outputs are masked out of the loss). Otherwise the model
  routes by itself, which `RoutingReplay.forward` reports by yielding False.
- ``moe_router_fusion`` bypasses replay in megatron-core 0.16.1 and is refused.
- Backward never re-routes, so forward replay is enough: ``trainer.recompute`` "selective"
  recomputes core attention only, and "full" (which would re-run the routers after the indices
  are cleared) is refused with routing replay; indices are cleared after each forward.
- Agreement is measured with replay on AND off: every router of an MoE policy carries an
  ``ObservingReplay`` (`observing_replay_class`), which also computes the router's own top-k
  (megatron's own function, on the trainer's hidden states) when a target is set. Over the
  training forwards `RoutingReplay` counts the (real token, layer) pairs whose own expert SET differs from the recorded one
  (``routing_differ_frac``) and the real tokens with any such layer (``routing_differ_token_frac``);
  prompt and completion positions alike, padding never. Under pipeline parallelism each stage
  counts its own layers; a token's flags are OR-ed over the stages at ``collect``. With replay on, later layers see the
  replayed earlier layers, so the two settings measure different things by design: "what would
  the trainer have chosen here" along the generator's path vs along its own.

Worked example: 2 rows of width S = 3, 1 layer, k = 2; row 0 routes its positions to
[[0,1],[2,3],[1,3]], row 1 (a padding-only dummy) gets [[0,1]]*3; the layer's target is rows
s-major: [[0,1],[0,1], [2,3],[0,1], [1,3],[0,1]] (6 = S*B tokens). With SP over tp = 3, rank 1
gets tokens 2 and 3 only: [[2,3],[0,1]].
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
import torch


def moe_routers(model) -> list:
    """The MoE routers of ``model`` (a megatron GPTModel, possibly DDP-wrapped), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def enable_routing_replay(model) -> int:
    """Attach an ``ObservingReplay`` to every router of ``model``; returns the number of MoE layers."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError("trainer.routing_replay needs an MoE model; this model has no routers")
    for router in routers:
        if router.config.moe_router_fusion:
            raise ValueError("moe_router_fusion bypasses routing replay in megatron-core 0.16.1")
        if not isinstance(router.router_replay, observing_replay_class()):
            router.router_replay = observing_replay_class()()
    return len(routers)


@lru_cache(maxsize=None)
def observing_replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class ObservingReplay(RouterReplay):
        """megatron's replay instance that, while a target is set, also keeps the router's own
        top-k choice (``own_topk``) for comparison; kept out of megatron's global instance list."""

        def __init__(self):
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)
            self.own_topk = None

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                            default_compute_topk: Callable | None = None):
            if self.target_topk_idx is not None:
                with torch.no_grad():
                    self.own_topk = default_compute_topk(scores.detach(), topk, num_groups=num_groups,
                                                         group_topk=group_topk)[1]
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

    return ObservingReplay


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
        for i, row, offset in zip(mb.sample_index, mb.rows, mb.offsets):
            if i >= 0:
                r = samples[i].routed_experts
                n = len(samples[i].prompt_ids) + len(samples[i].completion_ids) - 1
                if r.shape != (n, layers, k):
                    raise ValueError(f"sample {i}: routed_experts has shape {r.shape}, expected "
                                     f"({n}, {layers}, {k}) (prompt + completion - 1 positions)")
                if r.min() < 0:
                    raise ValueError(f"sample {i}: routed_experts holds -1 (a position the generator "
                                     "never computed) among the positions the trainer feeds")
                out[row, offset:offset + n] = r
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


class RoutingReplay:
    """The policy model's routers: replay recorded routing (``apply``) or only compare with it."""

    def __init__(self, model, apply: bool, tp_rank: int = 0, tp_size: int = 1,
                 sequence_parallel: bool = False, pp_group=None):
        self.layers = enable_routing_replay(model)  # this pipeline stage's MoE layers
        self.routers = moe_routers(model)
        self.model_layers = self.routers[0].config.num_layers  # the whole model's (every layer MoE)
        self.apply = apply
        self.tp_rank, self.tp_size, self.sequence_parallel = tp_rank, tp_size, sequence_parallel
        self.pp_group = pp_group  # pipeline group (None: no PP): stages OR their per-token flags
        self.differing_pairs = 0.0
        self.token_flags: list[torch.Tensor] = []  # per counted forward: real tokens with a differing layer

    @contextmanager
    def forward(self, routed: torch.Tensor | None, real: torch.Tensor | None = None):
        """Within the block the routers replay ``routed`` ([rows, S, layers, k]) if ``apply``, else
        route by themselves; with ``real`` ([rows, S] bool: positions holding real tokens) the
        own-vs-recorded differences are counted. Yields whether replay is active."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if routed is None:
            yield False
            return
        targets = layer_targets(routed, self.tp_rank, self.tp_size, self.sequence_parallel)
        if len(targets) != len(self.routers):
            raise ValueError(f"routing has {len(targets)} layers, the model {len(self.routers)} MoE layers")
        for router, target in zip(self.routers, targets):
            router.router_replay.set_target_indices(target)
            if self.apply:
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield self.apply
            if real is not None:
                self._count(targets, real)
        finally:
            for router in self.routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
                router.router_replay.own_topk = None

    def _count(self, targets, real) -> None:
        real = layer_targets(real[..., None, None], self.tp_rank, self.tp_size,
                             self.sequence_parallel)[0][:, 0].cpu()
        differ = torch.stack([
            (router.router_replay.own_topk.cpu().sort(-1).values != t.cpu().sort(-1).values).any(-1)
            for router, t in zip(self.routers, targets)], dim=1)[real]  # [real tokens, layers]
        self.differing_pairs += float(differ.sum())
        self.token_flags.append(differ.any(1))

    def collect(self, all_reduce) -> dict[str, float]:
        """Metrics since the last ``collect`` (a collective over the world; {} when no training
        forward carried routing), then reset."""
        flags = torch.cat(self.token_flags) if self.token_flags else torch.zeros(0, dtype=torch.bool)
        first_stage = True
        if self.pp_group is not None:  # every stage counted the same tokens in the same order
            flags = flags.double()
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.pp_group)
            first_stage = torch.distributed.get_rank(self.pp_group) == 0
        counts = [self.differing_pairs, float(flags.sum()) if first_stage else 0.0,
                  float(len(flags)) if first_stage else 0.0]  # differing pairs, differing tokens, tokens
        total = all_reduce(counts, None).cpu()  # TP duplicates cancel in the ratios
        self.differing_pairs, self.token_flags = 0.0, []
        if total[2] == 0:
            return {}
        return {"routing_differ_frac": float(total[0] / (total[2] * self.model_layers)),
                "routing_differ_token_frac": float(total[1] / total[2])}
