"""Token log-probabilities (and entropies) from the last hidden states, in memory linear in length.

The output layer and the log-softmax are fused and run over chunks of ``chunk`` tokens: at most
one chunk's ``[chunk, V/tp]`` fp32 logits exist at a time, in forward and in backward (which
recomputes them from the saved hidden states and weight). Nothing of size tokens x vocabulary is
kept; what is saved per token is one float (the log-normaliser).

Definitions (per token, ``z = h W^T / T`` over this rank's vocabulary shard, T the temperature,
K the kept set of Keep Sampling Mask or the whole vocabulary where a token has none)::

    logp(y) = z_y - logsumexp_{j in K} z_j          (= log p(y) - log P(K), sampling_mask.py)
    entropy = logsumexp_j z_j - sum_j p_j z_j        (whole vocabulary, no gradient)
    d logp / d z_j = [j = y] - p_K(j)               (p_K: softmax restricted to K)

Invariants:
- Equal to megatron's ``vocab_parallel_cross_entropy`` minus ``kept_log_mass`` on the full logits
  (tested against a plain log-softmax), and its gradients equal autograd's through them.
- Vocabulary-parallel: every rank holds a contiguous shard ``[r V/tp, (r+1) V/tp)``; maxima and
  sums are all-reduced over the tensor-parallel group in forward, once per chunk (one max, one
  stacked sum). Backward communicates nothing: the input's gradient is this shard's part, summed
  over TP by megatron's region functions around the output layer (`hidden_for_output`).
- ``hidden_for_output`` makes a megatron ``GPTModel`` return its final hidden states, prepared as
  its ``ColumnParallelLinear`` output layer would prepare them (gathered over the sequence under
  sequence parallelism, else copied into the TP region), plus the output weight (the embedding
  under tied embeddings). The output layer's own matmul never runs.

Worked example (one token, T = 1, vocabulary [2, 1, 0], kept {0, 1}, label 1): the set's
logsumexp is log(e^2 + e^1) = 2.313, logp = 1 - 2.313 = -1.313, as sampling_mask.py's example.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def _all_reduce(x: torch.Tensor, group, op=None) -> torch.Tensor:
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(x, op=op or torch.distributed.ReduceOp.SUM, group=group)
    return x


def _shard_start(weight: torch.Tensor, group) -> int:
    rank = 0 if group is None or torch.distributed.get_world_size(group) == 1 else torch.distributed.get_rank(group)
    return rank * weight.shape[0]


def _kept_set(kept: torch.Tensor | None, start: int, shard: int, rows: int, device) -> torch.Tensor | None:
    """``[rows, shard]`` bool: this shard's vocabulary entries in each token's kept set (every
    entry for a token without one); None when no token of the chunk has a set."""
    if kept is None:
        return None
    local = kept - start
    here = (kept >= 0) & (local >= 0) & (local < shard)
    inside = torch.zeros(rows, shard + 1, dtype=torch.bool, device=device)  # column ``shard``: elsewhere
    inside.scatter_(1, torch.where(here, local, shard).long(), True)
    inside = inside[:, :shard]
    has_set = (kept >= 0).any(-1, keepdim=True)
    return torch.where(has_set, inside, torch.ones_like(inside))


class _FusedLogprobs(torch.autograd.Function):
    """Chunked output layer + log-softmax (module docstring): returns ``(logp [N], entropy [N])``
    (entropy all-NaN unless asked for)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, kept, temperature, group, chunk, want_entropy):
        n, shard = hidden.shape[0], weight.shape[0]
        start = _shard_start(weight, group)
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 stays fp64)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.full((n,), float("nan"), dtype=dtype, device=hidden.device)
        set_lse = torch.empty(n, dtype=dtype, device=hidden.device)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            z = (hidden[a:b] @ weight.t()).to(dtype).div_(temperature)
            top = _all_reduce(z.max(-1).values, group, torch.distributed.ReduceOp.MAX)
            z.sub_(top[:, None])  # z - max: every exp below is <= 1
            local = labels[a:b] - start
            mine = (local >= 0) & (local < shard)
            picked = torch.where(mine, z.gather(1, local.clamp(0, shard - 1)[:, None])[:, 0], torch.zeros_like(top))
            inside = _kept_set(None if kept is None else kept[a:b], start, shard, b - a, hidden.device)
            stats = [picked]
            if want_entropy:
                e = z.exp()
                stats += [e.sum(-1), (e * z).sum(-1)]
                mass = stats[1] if inside is None else torch.where(inside, e, torch.zeros_like(e)).sum(-1)
                del e
            else:
                mass = (z.exp() if inside is None else torch.where(inside, z, torch.full_like(z, -torch.inf)).exp()).sum(-1)
            stacked = _all_reduce(torch.stack([*stats, mass]), group)
            set_lse[a:b] = stacked[-1].log() + top
            logp[a:b] = stacked[0] + top - set_lse[a:b]
            if want_entropy:
                entropy[a:b] = stacked[1].log() - stacked[2] / stacked[1]
        ctx.save_for_backward(hidden, weight, labels, kept if kept is not None else torch.empty(0), set_lse)
        ctx.has_kept, ctx.temperature, ctx.group, ctx.chunk = kept is not None, temperature, group, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, labels, kept, set_lse = ctx.saved_tensors
        kept = kept if ctx.has_kept else None
        n, shard = hidden.shape[0], weight.shape[0]
        start = _shard_start(weight, ctx.group)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dtype = set_lse.dtype
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for a in range(0, n, ctx.chunk):
            b = min(n, a + ctx.chunk)
            g = grad_logp[a:b].to(dtype)
            z = (hidden[a:b] @ weight.t()).to(dtype).div_(ctx.temperature)
            p = (z - set_lse[a:b, None]).exp_()  # softmax restricted to the kept set (masked below)
            inside = _kept_set(None if kept is None else kept[a:b], start, shard, b - a, hidden.device)
            if inside is not None:
                p.masked_fill_(~inside, 0.0)
            dz = p.mul_(-g[:, None])
            local = labels[a:b] - start
            mine = (local >= 0) & (local < shard)
            dz.scatter_add_(1, local.clamp(0, shard - 1)[:, None], torch.where(mine, g, torch.zeros_like(g))[:, None])
            dz = dz.div_(ctx.temperature).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[a:b] = (dz @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.add_(dz.t() @ hidden[a:b].to(weight.dtype))
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None, None, None)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   kept_ids: torch.Tensor | None = None, temperature: float = 1.0, tp_group=None,
                   chunk: int = 1024, want_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[rows, S]`` logprobs of ``labels`` (differentiable in ``hidden`` and ``weight``) and,
    with ``want_entropy``, ``[rows, S]`` entropies (no gradient), from ``hidden`` ``[rows, S, H]``
    and this rank's output-weight shard ``[V/tp, H]``; ``kept_ids`` ``[rows, S, W]`` (-1 padded)
    restricts the normaliser to the kept set (module docstring)."""
    if chunk < 1:
        raise ValueError(f"logprob chunk must be >= 1 token, got {chunk}")
    rows, length, width = hidden.shape
    kept = None if kept_ids is None else kept_ids.reshape(rows * length, -1)
    logp, entropy = _FusedLogprobs.apply(hidden.reshape(rows * length, width), weight,
                                         labels.reshape(-1).long(), kept, float(temperature), tp_group,
                                         int(chunk), bool(want_entropy))
    return logp.view(rows, length), (entropy.view(rows, length) if want_entropy else None)


@contextmanager
def hidden_for_output(gpt_model):
    """Within the block ``gpt_model(...)`` returns ``[rows, S, H]`` final hidden states prepared
    for the output layer instead of logits; yields a dict whose ``"weight"`` is set to the output
    weight by each forward (module invariants)."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    layer = gpt_model.output_layer
    seen: dict = {}

    def forward(input_, weight=None, runtime_gather_output=None):
        seen["weight"] = layer.weight if weight is None else weight
        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True), None
        return copy_to_tensor_model_parallel_region(input_), None

    layer.forward = forward
    try:
        yield seen
    finally:
        del layer.forward
