"""Context parallelism: every packed sequence split over the ``cp`` ranks of a context-parallel group.

With ``trainer.parallel.cp > 1`` (packed layout only) the ranks of one context-parallel group
build the same global micro-batches (`layout.PackedLayout` pads every segment to a multiple of
``2 cp``) and each feeds the model only its share of every segment (`ContextParallel.local`).
megatron-core's context parallelism needs Transformer Engine; here attention over the split is
our own (`context_parallel_attention`, called by `attention.VarlenAttention`) and megatron's own
THD rotary code (``_apply_rotary_pos_emb_thd`` with the CP group) rotates each local token by
its GLOBAL position, because ``packed_seq_params`` keeps the global ``cu_seqlens``.

Invariants:
- Load balance: a segment of length ``n`` (a multiple of ``2 cp``) is cut into ``2 cp`` chunks of
  ``c = n / (2 cp)``; rank r holds chunks r and 2cp-1-r, in that order, so every rank holds ``n / cp``
  tokens and the same causal work (query-key pairs). Local segment i starts at ``cu_seqlens[i] / cp``.
- Attention: all-gather of K/V per layer over the CP group (the Llama-3 approach), not a ring:
  one collective per layer instead of ``cp - 1`` exchanges, K/V are the small side under GQA, and
  attention then runs through the same memory-linear per-segment kernel as without CP
  (`attention`), with exact autograd on any device. Each local query sees the keys of its segment
  up to its global position (causal by global position): the rank's queries are placed at their
  global positions in a query block that ends with the rank's last chunk (other positions zero,
  their outputs dropped). Backward of the gather sums dK/dV over the group (an all-reduce, then
  this rank's slice: gloo has no reduce-scatter) and keeps this rank's part. Cost of that choice:
  rank r's query block is ``(2cp - r) c`` long (rank 0's is the whole segment), so the kernel's
  work and saved tensors, and the gathered K/V, do not shrink in proportion to cp, while every
  other activation does (a ring or a log-sum-exp-merging kernel would split them too).
- Logprobs and loss: each rank's per-token logprobs (fused, chunked, on its local tokens and
  sampling-mask sets) are all-gathered into the global ``[1, T]`` order (`gather`); every rank of
  the group then computes the same loss and metrics as one rank would. Backward keeps only this
  rank's positions of the (identical) gradient, so the per-rank parameter gradients sum, over
  DP x CP in megatron's DDP, to the one-rank gradient.
- Keep Routing replays, per local token, the recorded experts of its global position (``extras``
  of shape ``[1, T, ...]`` are cut like the tokens); routing counts use the exact mask of real
  positions (``MicroBatch.real``: segment padding is not a prefix).
- Every collective runs on megatron's context-parallel group, created with
  ``distributed_timeout_minutes`` (``trainer.timeout_s``).

Worked example: cp = 2, segments of 8 and 4 tokens (cu_seqlens [0, 8, 12]). Chunks: c = 2 and 1.
Rank 0 holds positions 0 1 6 7 | 8 11 (local cu_seqlens [0, 4, 6]); rank 1 holds 2 3 4 5 | 9 10.
Causal pairs of the first segment: rank 0 1+2+7+8 = 18, rank 1 3+4+5+6 = 18. Rank 0's query block
for it is positions 0..7 (its last chunk ends the segment), rank 1's is 0..5.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np
import torch


def rank_positions(bounds: list[int], cp: int, rank: int) -> np.ndarray:
    """Global positions rank ``rank`` of ``cp`` holds, in local order, for segment ``bounds``
    (``cu_seqlens`` as a list; every segment a multiple of ``2 cp``: module invariants)."""
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if (b - a) % (2 * cp):
            raise ValueError(f"segment {a}..{b} of length {b - a} does not split into 2*cp = {2 * cp} chunks")
        c = (b - a) // (2 * cp)
        parts += [np.arange(a + rank * c, a + (rank + 1) * c), np.arange(b - (rank + 1) * c, b - rank * c)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def gathered_order(bounds: list[int], cp: int) -> np.ndarray:
    """Index into the group's gathered local tensors (rank-major, ``cp * T / cp`` rows) giving
    the global order ``0 .. T - 1``."""
    return np.argsort(np.concatenate([rank_positions(bounds, cp, r) for r in range(cp)]), kind="stable")


class _GatherSplit(torch.autograd.Function):
    """All-gather of the local ``[t, ...]`` rows over the CP group into global order ``[T, ...]``;
    backward: this rank's rows of the gradient, summed over the group (``sum_grads``: K/V, read by
    every rank's queries) or as they are (logprobs: every rank computes the same loss)."""

    @staticmethod
    def forward(ctx, x, order, group, sum_grads):
        parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        ctx.order, ctx.group, ctx.sum_grads, ctx.rows = order, group, sum_grads, x.shape[0]
        return torch.cat(parts)[order]

    @staticmethod
    def backward(ctx, grad):
        flat = torch.empty_like(grad)
        flat[ctx.order] = grad
        if ctx.sum_grads:
            flat = flat.contiguous()
            torch.distributed.all_reduce(flat, group=ctx.group)
        rank = torch.distributed.get_rank(ctx.group)
        return flat[rank * ctx.rows:(rank + 1) * ctx.rows], None, None, None


def gather_split(x: torch.Tensor, bounds: list[int], group, sum_grads: bool) -> torch.Tensor:
    """This rank's local rows ``x`` (order `rank_positions`) -> all ``T`` rows in global order."""
    order = torch.as_tensor(gathered_order(bounds, torch.distributed.get_world_size(group)), device=x.device)
    return _GatherSplit.apply(x, order, group, sum_grads)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               scale: float, group, attend: Callable) -> torch.Tensor:
    """Causal attention of this rank's local queries ``q`` [t, heads, d] over the whole of each
    segment (``k``/``v`` [t, groups, d] local, gathered here); ``cu_seqlens`` global -> [t, heads, d].
    ``attend(q, k, v, cu_seqlens, max_seqlen, scale)`` is the packed causal kernel
    (`attention.varlen_causal_attention`), run on one query block at a time."""
    cp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    bounds = cu_seqlens.tolist()
    k_all, v_all = (gather_split(x, bounds, group, sum_grads=True) for x in (k, v))
    outs, local = [], 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        c = (b - a) // (2 * cp)
        rel = torch.as_tensor(rank_positions([0, b - a], cp, rank), device=q.device)
        end = b - a - rank * c  # the rank's last chunk ends here
        block = q.new_zeros((end,) + q.shape[1:]).index_copy(0, rel, q[local:local + 2 * c])
        whole = torch.tensor([0, end], dtype=torch.int32)
        outs.append(attend(block, k_all[a:a + end], v_all[a:a + end], whole, end, scale)[rel])
        local += 2 * c
    return torch.cat(outs)


class ContextParallel:
    """This rank's share of every micro-batch (build after megatron's groups)."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.group = ps.get_context_parallel_group()
        self.size = ps.get_context_parallel_world_size()
        self.rank = ps.get_context_parallel_rank()

    def local(self, mb):
        """The micro-batch this rank feeds the model: tokens, labels, masks and per-position
        extras at `rank_positions`, ``real`` the exact mask of real positions, global ``cu_seqlens``."""
        bounds = mb.packed_seq_params.cu_seqlens_q.tolist()
        width = mb.input_ids.shape[1]
        index = torch.as_tensor(rank_positions(bounds, self.size, self.rank), device=mb.input_ids.device)

        def cut(t):
            return t[:, index] if t.dim() >= 2 and t.shape[:2] == (1, width) else t

        return replace(mb, input_ids=cut(mb.input_ids), position_ids=cut(mb.position_ids), labels=cut(mb.labels),
                       loss_mask=cut(mb.loss_mask), real=mb.real_mask()[:, index.cpu()],
                       extras={k: cut(v) if torch.is_tensor(v) else v for k, v in mb.extras.items()})

    def gather(self, mb, values: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's ``[1, t]`` per-token values -> the micro-batch's ``[1, T]`` (differentiable:
        the gradient of this rank's positions, module invariants)."""
        if values is None:
            return None
        bounds = mb.packed_seq_params.cu_seqlens_q.tolist()
        return gather_split(values[0], bounds, self.group, sum_grads=False)[None]
