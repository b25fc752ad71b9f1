"""Keep Sampling Mask in the trainer: logprobs renormalised over the set sampling kept.

A generator sampling with top-k/top-p draws token y from ``p(y) / P(K)`` over the kept set K
(``pipeline/generator/capture.py`` records K per generated token); its behaviour logprob is
``log p(y) - log P(K)``. The trainer scores the same distribution::

    logp_K(y) = logp(y) - log sum_{j in K} p(j) = logit(y) - logsumexp_{j in K} logit(j)

Invariants:
- ``kept_log_mass`` is ``log P(K)`` (0 at positions without a recorded set: prompt, padding,
  samples without a mask), differentiable in the logits; the engine subtracts it from the full
  vocabulary logprob. It must run before megatron's cross entropy, which overwrites the logits.
- Vocabulary-parallel logits (each tensor-parallel rank holds a contiguous slice) are handled by
  summing each rank's share of the kept mass and of the full mass over the TP group; the sum's
  backward is the identity, as for every TP reduction whose result all ranks use alike.

Worked example: logits [2, 1, 0] (T = 1), kept {0, 1}, label 1: full logp(1) = 1 - 2.408 = -1.408,
log P(K) = log(e^2 + e^1) - 2.408 = 2.313 - 2.408 = -0.095, so logp_K(1) = -1.313.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class _SumOverGroup(torch.autograd.Function):
    """All-reduce SUM forward, identity backward (each rank's share feeds one shared total)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sum_over(x: torch.Tensor, group) -> torch.Tensor:
    if group is None or torch.distributed.get_world_size(group) == 1:
        return x
    return _SumOverGroup.apply(x, group)


def kept_log_mass(logits: torch.Tensor, kept_ids: torch.Tensor, tp_group=None) -> torch.Tensor:
    """``[rows, S]`` log of the probability mass of the kept set, ``log sum_{j in K} p(j)`` (0 where a
    position has no set: all -1), for this rank's vocabulary slice ``logits`` ([rows, S, V/tp],
    divided by the temperature already) and ``kept_ids`` ([rows, S, W] global ids, -1 padded).
    Subtract it from the full-vocabulary logprobs. Call it BEFORE megatron's
    ``vocab_parallel_cross_entropy``, which overwrites its input in place."""
    shard = logits.shape[-1]
    start = 0 if tp_group is None else torch.distributed.get_rank(tp_group) * shard
    with torch.no_grad():
        top = logits.max(dim=-1).values
        if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    z = logits - top[..., None]
    full = _sum_over(z.exp().sum(dim=-1), tp_group)
    local = kept_ids - start
    here = (kept_ids >= 0) & (local >= 0) & (local < shard)
    picked = z.gather(-1, local.clamp(0, shard - 1).long())
    kept = _sum_over(torch.where(here, picked.exp(), torch.zeros_like(picked)).sum(dim=-1), tp_group)
    has_set = (kept_ids >= 0).any(dim=-1)
    return torch.where(has_set, kept.clamp(min=torch.finfo(kept.dtype).tiny).log() - full.log(),
                       torch.zeros_like(full))


def attach_kept_ids(micro_batches: Sequence, samples: Sequence, device) -> list:
    """Set ``extras['kept_ids']`` ([rows, S, W], -1 padded) on micro-batches holding a sample with
    a ``sampling_mask``; rows are placed like the layout places completion tokens."""
    for mb in micro_batches:
        masks = [samples[i].sampling_mask if i >= 0 else None for i in mb.sample_index]
        if all(m is None for m in masks):
            continue
        width = max(m.shape[1] for m in masks if m is not None)
        rows, length = mb.loss_mask.shape
        kept = np.full((rows, length, width), -1, dtype=np.int64)
        for m, row, start, c in zip(masks, mb.rows, mb.starts, mb.lengths):
            if m is not None:
                if len(m) != c:
                    raise ValueError(f"sampling_mask has {len(m)} rows for {c} completion tokens")
                kept[row, start:start + c, :m.shape[1]] = m
        mb.extras["kept_ids"] = torch.from_numpy(kept).to(device)
    return list(micro_batches)
