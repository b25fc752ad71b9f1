"""Which trainer layouts of ``gpus`` GPUs fit, best first; a refusal that names what binds.

A layout fits when its planned peak (`pipeline.plan.memory.rank_memory`) is at most ``usable`` x the
GPU's memory (the rest: CUDA context, NCCL buffers, allocator fragmentation). Candidates: every tp,
pp, cp, ep (etp as the trainer defaults it: 1 for MoE with ep > 1, as megatron recommends, else tp) whose products divide ``gpus``, recomputation
none / selective / full, and optimizer offload 0 / 0.5 / 1.

Order (cheapest in step time first): less optimizer offload (a host Adam step), then fewer pipeline
stages (bubble), fewer context-parallel ranks (exchanges in every attention), no full recomputation
(a third more compute), smaller tp, no selective recomputation, then the lower peak. Example: Qwen3-30B-A3B on 8 x 80 GB at 8k tokens with packed
attention and chunked logits: the first fitting layout is printed by ``tokenflow plan`` and kept in
bench/results/2026-12-06-plan.md.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

from pipeline.plan.memory import GiB, Layout, MemoryPlan, rank_memory
from pipeline.plan.shape import ModelShape

USABLE = 0.9  # share of a GPU's memory a plan may fill


def _powers_of_two(limit: int) -> list[int]:
    return [2 ** i for i in range(limit.bit_length()) if 2 ** i <= limit]


def candidates(shape: ModelShape, base: Layout) -> list[Layout]:
    """Every layout of ``base.world`` ranks that divides (``base`` gives the batch and dtypes)."""
    out = []
    sizes = _powers_of_two(base.world)
    for tp, pp, cp, ep in itertools.product(sizes, sizes, sizes, sizes if shape.is_moe else [1]):
        for recompute, offload in itertools.product(("none", "selective", "full"), (0.0, 0.5, 1.0)):
            if recompute == "selective" and base.attention != "local":
                continue  # selective recomputation drops the S x S scores, which only local attention saves
            etp = tp if shape.is_moe and ep == 1 else 1  # the trainer's default (ParallelConfig.expert_tp)
            layout = replace(base, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, recompute=recompute, offload=offload)
            try:
                layout.check(shape)
            except ValueError:
                continue
            out.append(layout)
    return out


def order_key(plan: MemoryPlan) -> tuple:
    L = plan.layout
    return (L.offload, L.pp, L.cp, L.recompute == "full", L.tp, L.recompute == "selective", plan.peak)


def fitting(shape: ModelShape, base: Layout, gpu_bytes: float, usable: float = USABLE) -> list[MemoryPlan]:
    """The plans of every candidate layout that fits, best first."""
    plans = [rank_memory(shape, layout) for layout in candidates(shape, base)]
    return sorted((p for p in plans if p.peak <= usable * gpu_bytes), key=order_key)


def refusal(plan: MemoryPlan, gpu_bytes: float, usable: float = USABLE) -> str | None:
    """None when ``plan`` fits, else a sentence naming its peak, the limit and the largest parts."""
    limit = usable * gpu_bytes
    if plan.peak <= limit:
        return None
    top = sorted(plan.components.items(), key=lambda kv: -kv[1])[:3]
    parts = ", ".join(f"{name} {value / GiB:.1f} GiB" for name, value in top)
    return (f"peak {plan.peak / GiB:.1f} GiB per rank exceeds {limit / GiB:.1f} GiB "
            f"({usable:.0%} of {gpu_bytes / GiB:.0f} GiB); {plan.binding()} binds ({parts})")
