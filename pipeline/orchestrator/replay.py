"""Offline replay: recorded groups of another run's rollout log stand in for live generators.

Invariants:
- source groups are fed in the order they were stored (global row order), each at most once per
  replay run: groups already in this run's own log (a resumed replay) are skipped;
- a fed group keeps its recorded rewards, behaviour logprobs and token versions, so the trainer's
  importance weights are taken against the policy that really sampled it;
- the feeder never reads ahead more than it is asked for (the buffer's memory bound holds).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.rollout_log.format import GroupOutcome
from pipeline.rollout_log.reader import RolloutLog
from pipeline.protocol.sample_batch import SampleBatch


class LogFeeder:
    def __init__(self, source: Path, already_fed: set[int]):
        self.log = RolloutLog.open(source)
        g = self.log.groups()
        stored = np.flatnonzero(g["outcome"] == GroupOutcome.STORED)
        order = stored[np.argsort(g["first_row"][stored], kind="stable")]
        self.queue = [(int(g["group_id"][i]), int(g["first_row"][i]), int(g["n_samples"][i]))
                      for i in order if int(g["group_id"][i]) not in already_fed]
        self.total = len(order)
        self.position = 0

    @property
    def remaining(self) -> int:
        return len(self.queue) - self.position

    def next_group(self) -> tuple[int, SampleBatch] | None:
        """(group id, its samples) of the next recorded group, or None when the source is spent."""
        if self.position >= len(self.queue):
            return None
        gid, first, n = self.queue[self.position]
        self.position += 1
        return gid, self.log.read(np.arange(first, first + n, dtype=np.int64))

    def close(self) -> None:
        self.log.close()
