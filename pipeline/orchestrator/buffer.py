"""The rollout buffer: kept groups waiting for the trainer, in memory up to a token budget.

Every group in the buffer is already in the rollout log (it is added only after being appended),
so "spilling" costs nothing: a group beyond the memory budget keeps just its log rows and is read
back from the log when a step takes it.

Invariants:
- groups leave in arrival order (oldest first), each at most once: by `take` into a step or by
  `drop` (the orchestrator releases stale groups and groups a rollback discarded);
- tokens held in memory never exceed ``memory_token_budget`` (a single group larger than the whole
  budget is spilled at once).

Worked example: budget 10,000 tokens, groups of 8 samples x 1,000 tokens: the first group stays in
memory (8,000), the second would reach 16,000 and is spilled; after the first leaves, the third is
held in memory again.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.protocol.sample_batch import SampleBatch


@dataclass
class BufferedGroup:
    group_id: int
    attempt: int
    rows: np.ndarray
    """Global rows of the group's samples in the rollout log."""
    min_version: int
    num_tokens: int
    batch: SampleBatch | None
    """The samples, or None when spilled to the log."""


class RolloutBuffer:
    def __init__(self, memory_token_budget: int, read_rows: Callable[[np.ndarray], SampleBatch]):
        self.budget = memory_token_budget
        self.read_rows = read_rows
        self.groups: OrderedDict[int, BufferedGroup] = OrderedDict()
        self.memory_tokens = 0
        self.spilled_total = 0

    def add(self, group: BufferedGroup, front: bool = False) -> None:
        """Queue a group last (or first: a group returned by a rolled-back step)."""
        if group.group_id in self.groups:
            raise ValueError(f"group {group.group_id} is already buffered")
        if group.batch is not None and self.memory_tokens + group.num_tokens > self.budget:
            group.batch = None
            self.spilled_total += 1
        if group.batch is not None:
            self.memory_tokens += group.num_tokens
        self.groups[group.group_id] = group
        if front:
            self.groups.move_to_end(group.group_id, last=False)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def spilled(self) -> int:
        return sum(g.batch is None for g in self.groups.values())

    def _remove(self, gid: int) -> BufferedGroup:
        g = self.groups.pop(gid)
        if g.batch is not None:
            self.memory_tokens -= g.num_tokens
        return g

    def samples(self, group: BufferedGroup) -> SampleBatch:
        """A buffered group's samples (read back from the log when spilled; it stays spilled)."""
        return group.batch if group.batch is not None else self.read_rows(group.rows)

    def drop(self, which: Callable[[BufferedGroup], bool]) -> list[BufferedGroup]:
        """Remove and return the groups ``which`` selects (stale ones, rolled-back ones)."""
        return [self._remove(gid) for gid in [gid for gid, g in self.groups.items() if which(g)]]

    def take(self, n_groups: int) -> list[BufferedGroup]:
        """The ``n_groups`` oldest groups with their samples loaded (spilled ones read back)."""
        if n_groups > len(self.groups):
            raise ValueError(f"asked for {n_groups} groups, {len(self.groups)} buffered")
        taken = [self._remove(gid) for gid in list(self.groups)[:n_groups]]
        spilled = [g for g in taken if g.batch is None]
        if spilled:
            rows = np.concatenate([g.rows for g in spilled])
            loaded = self.read_rows(rows)
            start = 0
            for g in spilled:
                g.batch = loaded.take(np.arange(start, start + len(g.rows)))
                start += len(g.rows)
        return taken
