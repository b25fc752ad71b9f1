"""Step batches: the data-parallel split balanced by training cost.

A sample of T tokens costs ``linear * T + quadratic * T**2`` (`StepCost`): the matrix products grow
with T, attention's scores with T squared. From a model's shape (`StepCost.of_shape`), counting the
FLOPs of a forward and backward pass (3 x the forward's):

- linear: 6 x the parameters a token passes through (attention, the dense MLP or its top-k experts
  and router, the output layer);
- quadratic: 12 x layers x query heads x head_dim (Q K^T and P V, 2 q d FLOPs per token pair each,
  over the full S x S square, as megatron's local attention computes it).

Invariants:
- every sample of a step goes to exactly one data-parallel rank;
- ranks receive whole samples, assigned costliest-first to the rank with the least cost so far
  (LPT), so the costliest rank holds at most the cheapest rank's cost plus one sample's;
- groups may be spread across ranks: the trainer computes GRPO advantages over the whole
  batch (all ranks), so the split never changes them.

Worked example (tokens only, ``StepCost()``): token counts [90, 50, 40, 30, 10] over 2 ranks:
90 -> r0, 50 -> r1, 40 -> r1 (90), 30 -> r0 (120), 10 -> r1 (100): ranks hold 120 and 100 tokens.
With ``StepCost(linear=1, quadratic=0.01)`` the costs are [171, 75, 56, 39, 11]: 171 -> r0, the
rest -> r1 (181): 90 tokens against 130, but cost 171 against 181.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepCost:
    """Relative training cost of one sample: ``linear * T + quadratic * T**2``."""

    linear: float = 1.0  # cost per token
    quadratic: float = 0.0  # cost per token pair (0: balance by tokens)

    @classmethod
    def of_shape(cls, shape) -> "StepCost":
        """FLOPs of a forward and backward pass of a `pipeline.plan.shape.ModelShape`."""
        mlp = shape.n_router + shape.top_k * 3 * shape.hidden * shape.expert_ffn if shape.is_moe \
            else shape.n_dense_mlp
        per_token = shape.layers * (shape.n_attention + mlp) + shape.vocab * shape.hidden
        return cls(linear=6.0 * per_token, quadratic=12.0 * shape.layers * shape.heads * shape.head_dim)

    def of(self, num_tokens: np.ndarray) -> np.ndarray:
        t = np.asarray(num_tokens, dtype=np.float64)
        return self.linear * t + self.quadratic * t * t


def split_by_cost(num_tokens: np.ndarray, dp_size: int, cost: StepCost = StepCost()) -> np.ndarray:
    """Data-parallel rank of each sample (see the module docstring)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    costs = cost.of(num_tokens)
    ranks = np.zeros(len(costs), dtype=np.int16)
    heap = [(0.0, r) for r in range(dp_size)]
    for i in np.argsort(-costs, kind="stable"):
        load, r = heapq.heappop(heap)
        ranks[i] = r
        heapq.heappush(heap, (load + float(costs[i]), r))
    return ranks
