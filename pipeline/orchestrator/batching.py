"""Step batches: the data-parallel split balanced by training cost.

A sample of T tokens costs ``per_sample + linear * T + quadratic * T**2`` (`StepCost`): the matrix
products grow with T, attention's scores with T squared, and each sample has a fixed share (its
attention call, its per-sequence loss terms). From a model's shape (`StepCost.of_shape`), counting the
FLOPs of a forward and backward pass (3 x the forward's):

- linear: 6 x the parameters a token passes through (attention, the dense MLP or its top-k experts
  and router, the output layer);
- quadratic: 12 x layers x query heads x head_dim (Q K^T and P V, 2 q d FLOPs per token pair each,
  over the full S x S square).

FLOPs are not time: on CPU a step of the tiny test model grows 5.5x from 128 to 1,024 tokens where
its FLOPs grow 13.1x (fixed per-step work, memory-bound kernels, causal attention skipping half the
square, per-sample work). ``StepCost.fit`` measures the coefficients instead: a non-negative
least-squares fit of ``fixed + k * (per_sample + linear * T + quadratic * T**2)`` seconds to step
times of steps of k samples of T tokens over a length grid (``fixed``, paid once per rank and
step, does not change the split and is returned apart; ``per_sample`` needs two values of k).
``orchestrator.step_cost_per_token`` / ``step_cost_per_token_pair`` / ``step_cost_per_sample`` take the fit (`bench/dp_balance.py` measures and prints it);
unset, the orchestrator uses the FLOPs model.

Invariants:
- every sample of a step goes to exactly one data-parallel rank;
- ranks receive whole samples, assigned costliest-first to the rank with the least cost so far
  (LPT; ties to the rank with fewer samples, so a cost of 0, e.g. a fit that found no length
  dependence, deals samples round-robin), so the costliest rank holds at most the cheapest rank's
  cost plus one sample's;
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
    """Relative training cost of one sample: ``per_sample + linear * T + quadratic * T**2``."""

    linear: float = 1.0  # cost per token
    quadratic: float = 0.0  # cost per token pair (0: balance by tokens)
    per_sample: float = 0.0  # cost of a sample whatever its length

    @classmethod
    def of_shape(cls, shape) -> "StepCost":
        """FLOPs of a forward and backward pass of a `pipeline.plan.shape.ModelShape`."""
        mlp = shape.n_router + shape.top_k * 3 * shape.hidden * shape.expert_ffn if shape.is_moe \
            else shape.n_dense_mlp
        per_token = shape.layers * (shape.n_attention + mlp) + shape.vocab * shape.hidden
        return cls(linear=6.0 * per_token, quadratic=12.0 * shape.layers * shape.heads * shape.head_dim)

    @classmethod
    def fit(cls, num_tokens, seconds, samples=None) -> tuple["StepCost", float]:
        """(cost in seconds, fixed seconds) fitted to step times ``seconds`` of steps of
        ``samples[i]`` samples (None: 1 each) of ``num_tokens[i]`` tokens each: the least-squares
        ``fixed + k * (per_sample + linear * T + quadratic * T**2)`` with every coefficient >= 0
        (the best fit over the subsets of terms whose own fit is non-negative; ``per_sample`` only
        when the steps hold two or more values of k). Example: T [1, 2, 3], seconds [3, 7, 13]
        -> linear 1, quadratic 1, fixed 1."""
        t = np.asarray(num_tokens, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        k = np.ones_like(t) if samples is None else np.asarray(samples, dtype=np.float64)
        if not t.shape == y.shape == k.shape or len(np.unique(t)) < 3:
            raise ValueError(f"a step-cost fit needs step times at >= 3 distinct lengths, got "
                             f"{len(np.unique(t))} lengths for {y.size} times")
        scale = t.max()
        columns = np.stack([np.ones_like(t), k, k * t / scale, k * (t / scale) ** 2], axis=1)
        usable = [0, 1, 2, 3] if len(np.unique(k)) > 1 else [0, 2, 3]
        best, best_residual = np.zeros(4), np.inf
        for mask in range(1, 16):
            terms = [j for j in range(4) if mask >> j & 1]
            if not set(terms) <= set(usable):
                continue
            x, *_ = np.linalg.lstsq(columns[:, terms], y, rcond=None)
            residual = float(np.sum((columns[:, terms] @ x - y) ** 2))
            if (x >= 0).all() and residual < best_residual:
                best, best_residual = np.zeros(4), residual
                best[terms] = x
        return cls(linear=float(best[2] / scale), quadratic=float(best[3] / scale ** 2),
                   per_sample=float(best[1])), float(best[0])

    def of(self, num_tokens: np.ndarray) -> np.ndarray:
        t = np.asarray(num_tokens, dtype=np.float64)
        return self.per_sample + self.linear * t + self.quadratic * t * t


def split_by_cost(num_tokens: np.ndarray, dp_size: int, cost: StepCost = StepCost()) -> np.ndarray:
    """Data-parallel rank of each sample (see the module docstring)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    costs = cost.of(num_tokens)
    ranks = np.zeros(len(costs), dtype=np.int16)
    heap = [(0.0, 0, r) for r in range(dp_size)]  # (cost so far, samples so far, rank)
    for i in np.argsort(-costs, kind="stable"):
        load, count, r = heapq.heappop(heap)
        ranks[i] = r
        heapq.heappush(heap, (load + float(costs[i]), count + 1, r))
    return ranks
