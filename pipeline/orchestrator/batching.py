"""Step batches: the token-balanced data-parallel split.

Invariants:
- every sample of a step goes to exactly one data-parallel rank;
- ranks receive whole samples, assigned longest-first to the rank with the fewest tokens so far
  (LPT), so the largest rank holds at most the smallest rank's tokens plus one sample's;
- groups may be spread across ranks: the trainer computes GRPO advantages over the whole
  batch (all ranks), so the split never changes them.

Worked example: token counts [90, 50, 40, 30, 10] over 2 ranks: 90 -> r0, 50 -> r1, 40 -> r1 (90),
30 -> r0 (120), 10 -> r1 (100): ranks hold 120 and 100 tokens.
"""
from __future__ import annotations

import heapq

import numpy as np


def split_by_tokens(num_tokens: np.ndarray, dp_size: int) -> np.ndarray:
    """Data-parallel rank of each sample (see the module docstring)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    ranks = np.zeros(len(num_tokens), dtype=np.int16)
    heap = [(0, r) for r in range(dp_size)]
    for i in np.argsort(-np.asarray(num_tokens), kind="stable"):
        load, r = heapq.heappop(heap)
        ranks[i] = r
        heapq.heappush(heap, (load + int(num_tokens[i]), r))
    return ranks
