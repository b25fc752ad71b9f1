"""Causal attention over packed (THD) or padded sequences that never holds an S x S tensor.

megatron-core 0.16.1's local ``DotProductAttention`` builds the ``[b, heads, s, s]`` score matrix
and refuses packed sequences (it asserts ``packed_seq_params is None``; only TransformerEngine
packs). ``VarlenAttention`` takes its place in the local layer spec (``megatron_patches``, the
``varlen_attention`` patch, applied for every layout) with the same constructor and forward
signature, so packed and padded batches run the same attention code on the same sequences.

Invariants:
- Each segment ``cu_seqlens[i] .. cu_seqlens[i+1]`` of a packed micro-batch attends causally to
  itself only. A padded batch ([s, b, heads, d]) carries its rows' real lengths as
  ``PackedSeqParams(qkv_format="sbhd")`` with ``cu_seqlens_q`` the running sum of the row lengths:
  row i's first ``n_i`` positions are one causal segment, run through the same per-segment call as
  a packed segment of that sequence; its padding is never attended and its output there is 0.
  Without ``packed_seq_params`` every row is one sequence of length s.
  The result is megatron's attention of each sequence alone (same scale ``1/sqrt(d)``, same GQA
  grouping: query head h reads key/value group ``h // (heads / groups)``).
- Memory is linear in the packed length: every kernel used keeps per-query statistics (the
  log-sum-exp) instead of the score matrix, in forward and backward. On CPU that is torch's
  flash-attention kernel for CPU, run per segment; on CUDA with fp16/bf16 torch's
  ``varlen_attn`` over the whole packed tensor, otherwise per-segment SDPA restricted to the flash
  and memory-efficient backends. ``sdpa_kernel`` pins those backends, so a shape they cannot take
  raises instead of silently falling back to the math kernel, which would build S x S.
- Attention dropout, attention bias, explicit masks and sliding windows are refused (the trainer's
  models use none of them). Under context parallelism (packed only) attention runs over the split
  sequences (`pipeline.trainer.context_parallel`).

Worked example: cu_seqlens [0, 3, 5] over t = 5 packed tokens: tokens 0..2 attend causally among
themselves, tokens 3..4 among themselves; token 3 never sees tokens 0..2. The per-query
statistics are 5 x heads floats; the score matrix would have been 5 x 5 x heads. The same two
sequences padded to s = 3 (rows [a0 a1 a2], [b0 b1 pad]) carry cu_seqlens [0, 3, 5]: row 1 runs
attention over b0 b1 only, exactly as the packed segment 3..4 does, and its position 2 is 0.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence: ``q`` [s, heads, d], ``k``/``v`` [s, groups, d] ->
    [s, heads, d], through the memory-linear SDPA backends only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] if q.is_cuda
                else [SDPBackend.FLASH_ATTENTION])
    if q.is_cuda and k.shape[1] != q.shape[1]:  # the memory-efficient CUDA kernel takes no GQA
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, s, d]
    with sdpa_kernel(backends):
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=kh.shape[1] != qh.shape[1])
    return out.squeeze(0).transpose(0, 1)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float) -> torch.Tensor:
    """Packed causal attention: ``q`` [t, heads, d], ``k``/``v`` [t, groups, d], segments
    ``cu_seqlens`` (int32, [n + 1], last = t) -> [t, heads, d] (module invariants)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0),
                           enable_gqa=k.shape[1] != q.shape[1])
    bounds = cu_seqlens.tolist()
    return torch.cat([_segment_attention(q[a:b], k[a:b], v[a:b], scale)
                      for a, b in zip(bounds[:-1], bounds[1:]) if b > a])


class VarlenAttention(MegatronModule):
    """Drop-in core attention for megatron's local layer spec (module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"VarlenAttention has no attention dropout (got {dropout})")
        self.cp_group = getattr(pg_collection, "cp", None)  # context parallelism: its group
        if config.context_parallel_size != 1 and self.cp_group is None:
            from megatron.core import parallel_state as ps

            self.cp_group = ps.get_context_parallel_group()
        if config.window_size is not None:
            raise ValueError("VarlenAttention has no sliding window")
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            raise ValueError("VarlenAttention does not scale query-key products per layer")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("VarlenAttention takes no attention bias")
        if attention_mask is not None:
            raise ValueError("VarlenAttention is causal only: an explicit attention mask is not supported")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if self.config.context_parallel_size > 1:
                from .context_parallel import context_parallel_attention

                out = context_parallel_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                                 self.softmax_scale, self.cp_group, varlen_causal_attention)
                return out.reshape(out.shape[0], -1)  # [t, heads * d]
            out = varlen_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                          int(packed_seq_params.max_seqlen_q), self.softmax_scale)
            return out.reshape(out.shape[0], -1)  # [t, heads * d]
        if self.config.context_parallel_size > 1:
            raise ValueError("context parallelism needs packed sequences (trainer.layout=packed)")
        s, b = query.shape[:2]
        lengths = [s] * b if packed_seq_params is None else packed_seq_params.cu_seqlens_q.diff().tolist()
        if len(lengths) != b or max(lengths) > s:
            raise ValueError(f"padded rows: {len(lengths)} real lengths (longest {max(lengths)}) for "
                             f"{b} rows of {s} positions")
        out = query.new_zeros(s, b, query.shape[2] * query.shape[3])
        for i, n in enumerate(lengths):
            if n:
                out[:n, i] = _segment_attention(query[:n, i], key[:n, i], value[:n, i],
                                                self.softmax_scale).reshape(n, -1)
        return out  # [s, b, heads * d]
