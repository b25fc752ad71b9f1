"""An MoE layer's local experts as grouped matrix products instead of one loop step per expert.

megatron-core 0.16.1 groups experts only through Transformer Engine (``TEGroupedMLP``) or the
``grouped_gemm`` package (``GroupedMLP``), neither installed here. `GroupedExperts` keeps
megatron's ``SequentialMLP`` parameters exactly (``local_experts.J.linear_fc1.weight``
``[2 f / etp, h]`` rows ``[gate; up]``, ``linear_fc2.weight`` ``[h, f / etp]``), so conversion,
checkpoints, exports and weight sync see no difference, and replaces only the forward:

- the dispatcher hands over the tokens sorted by local expert, ``tokens_per_expert[j]`` rows each;
- GPU, bf16 (``torch._grouped_mm``, Hopper and later): one grouped product for fc1 and one for fc2
  over the stacked weights, segment ``j`` of the rows against weight ``j``;
- otherwise (CPU, fp32): the rows are scattered into a zero-padded ``[E, max_j tokens, h]`` block,
  and fc1 / fc2 are two batched products (``torch.bmm``); padded rows are never read back;
- between them, as megatron's MLP: ``silu(gate) * up``, times each row's routing probability.

Gradients reach each expert's own parameters through the stack. Outputs and gradients equal the
loop's within fp32 rounding (tests/trainer/test_grouped_experts.py: 1e-6). Falls back to the loop
where the forward is not the plain one: one local expert, LoRA adapters on the experts (forward
hooks on their linear layers), probabilities applied on the input, FP8/FP4.

Worked example: 4 local experts, tokens_per_expert [3, 0, 5, 1], h 256: the padded block is
``[4, 5, 256]``; expert 1's slice is all padding, expert 3 uses one row of five.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` with the same parameters and a grouped forward (module docstring)."""

    def groups(self) -> bool:
        """True when this forward runs grouped (else megatron's loop: the module docstring)."""
        c = self.config
        return (self.num_local_experts > 1 and not c.moe_apply_probs_on_input and not c.fp8
                and not getattr(c, "fp4", None) and c.gated_linear_unit and c.activation_func is F.silu
                and not c.add_bias_linear and getattr(c, "activation_func_clamp_value", None) is None
                and not getattr(c, "glu_linear_offset", 0.0)
                and not any(hasattr(e.linear_fc1, "lora_A") or hasattr(e.linear_fc2, "lora_A")
                            for e in self.local_experts))

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self.groups():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x, probs = permuted_local_hidden_states, permuted_probs
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, 2f, h]
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, h, f]
        counts = tokens_per_expert.to(device=x.device, dtype=torch.long)
        if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h1 = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)
            return torch._grouped_mm(self._activate(h1, probs), w2.transpose(1, 2), offs=offs), None
        expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
        width = int(counts.max()) if x.shape[0] else 0
        block = x.new_zeros(len(counts), width, x.shape[1]).index_put((expert, slot), x)
        scale = probs.new_zeros(len(counts), width).index_put((expert, slot), probs)
        h1 = torch.bmm(block, w1.transpose(1, 2))
        out = torch.bmm(self._activate(h1, scale), w2.transpose(1, 2))
        return out[expert, slot], None

    @staticmethod
    def _activate(h1, probs):
        """``silu(gate) * up`` times the routing probability, in the activations' dtype (as
        megatron's MLP with a per-token scale)."""
        gate, up = torch.chunk(h1, 2, dim=-1)
        return (F.silu(gate) * up * probs.unsqueeze(-1)).to(h1.dtype)
