"""The step desk: step batches and the step record (`docs/architecture.md`, "Staleness,
admission and the policy clock" and "Contracts").

Invariants:
- step k's batch is the ``groups_per_step`` oldest buffered groups (ordered by group id within the
  step), recorded in the log with the data-parallel rank of every sample; `serve` returns the
  replies only after recording, and the caller flushes the log before sending them, so no trainer
  rank sees a step the log does not hold; asking again for a recorded step returns the same
  samples (each rank gets its own share);
- `forget_from(k)` (a trainer resuming from the checkpoint after k steps) drops the record of
  steps k and later and returns their groups, oldest step first, for the caller to decide (back to
  the front of the buffer, or dropped by the rollback: `roll_back`); ranks still waiting for
  those steps are forgotten too.

The desk does not judge staleness, count or log outcomes: the orchestrator does (with the policy
clock) before calling `serve`.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from pipeline.orchestrator.batching import StepCost, split_by_cost
from pipeline.orchestrator.buffer import BufferedGroup, RolloutBuffer
from pipeline.protocol.links import batch_arrays
from pipeline.protocol.messages import Batch, GetBatch
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.rollout_log.writer import RolloutLogWriter


class StepDesk:
    def __init__(self, groups_per_step: int, writer: RolloutLogWriter, buffer: RolloutBuffer,
                 step_rows: dict[int, tuple[np.ndarray, np.ndarray]], cost: StepCost = StepCost()):
        self.groups_per_step, self.writer, self.buffer = groups_per_step, writer, buffer
        self.cost = cost
        """What a sample costs the trainer (the data-parallel split balances it)."""
        self.step_rows = step_rows
        """step -> (log rows, DP rank of each row) of every recorded step."""
        self.waiting: dict[bytes, GetBatch] = {}
        """trainer peer -> the request it waits on."""

    def request(self, peer: bytes, req: GetBatch) -> Batch | None:
        """The reply to a recorded step at once; else None and the request waits for `serve`."""
        if req.step in self.step_rows:
            self.waiting.pop(peer, None)
            return self._reply(req, *self._read(req.step))
        self.waiting[peer] = req
        return None

    def serve(self, trainer_step: int) -> tuple[list[tuple[bytes, Batch]], bool]:
        """Replies for waiting ranks whose step is recorded or can be recorded now from the
        buffer; and whether a step was recorded (the caller flushes the log before sending)."""
        replies, recorded = [], False
        for peer, req in list(self.waiting.items()):
            if req.step in self.step_rows:  # another trainer rank asked first
                batch, ranks = self._read(req.step)
            elif len(self.buffer) >= self.groups_per_step:
                batch, ranks = self._record(req, trainer_step)
                recorded = True
            else:
                continue
            del self.waiting[peer]
            replies.append((peer, self._reply(req, batch, ranks)))
        return replies, recorded

    def _record(self, req: GetBatch, trainer_step: int) -> tuple[SampleBatch, np.ndarray]:
        # Oldest groups first; within the step in group order, so that a synchronous run whose
        # groups finished in another order still trains on an identical batch.
        groups = sorted(self.buffer.take(self.groups_per_step), key=lambda g: g.group_id)
        batch = SampleBatch.concat([g.batch for g in groups])
        rows = np.concatenate([g.rows for g in groups])
        lengths = batch.columns["prompt_len"] + batch.columns["completion_len"]
        ranks = split_by_cost(lengths, req.dp_size, self.cost)
        self.writer.append_steps(req.step, rows, ranks, trainer_step, time.time())
        self.step_rows[req.step] = (rows, ranks)
        return batch, ranks

    def _read(self, step: int) -> tuple[SampleBatch, np.ndarray]:
        rows, ranks = self.step_rows[step]
        return self.writer.read_samples(rows), ranks

    @staticmethod
    def _reply(req: GetBatch, batch: SampleBatch, ranks: np.ndarray) -> Batch:
        """A step's samples (only ``req.dp_rank``'s share if given) with their DP ranks."""
        if req.dp_rank is not None:
            sel = np.flatnonzero(ranks == req.dp_rank)
            batch, ranks = batch.take(sel), ranks[sel]
        arrays = batch_arrays(batch)
        arrays["dp_rank"] = ranks
        return Batch(req.step, req.dp_rank, arrays)

    def forget_from(self, k: int) -> list[BufferedGroup]:
        """Drop the record of steps >= k; their groups, oldest step first, in group order."""
        groups = []
        for s in sorted(s for s in self.step_rows if s >= k):
            rows, _ = self.step_rows.pop(s)
            batch = self.writer.read_samples(rows)
            gids = batch.columns["group_id"]
            for gid in dict.fromkeys(gids.tolist()):
                sel = np.flatnonzero(gids == gid)
                group = batch.take(sel)
                groups.append(BufferedGroup(gid, int(group.columns["attempt"][0]), rows[sel],
                                            int(group.min_versions().min()), group.num_tokens, group))
        self.waiting = {p: w for p, w in self.waiting.items() if w.step < k}
        return groups

    def roll_back(self, k: int, discarded: Callable[[BufferedGroup], bool]) -> tuple[list[BufferedGroup], int]:
        """A trainer resumes after k steps: forget steps >= k and put their groups back at the
        front of the buffer (oldest first), except the `discarded` ones (tokens of weights the
        rollback threw away), which leave the buffer too. Returns (groups to release, number of
        groups the forgotten steps held)."""
        returned = self.forget_from(k)
        released = self.buffer.drop(discarded)
        for g in reversed(returned):  # the oldest ends up first
            if discarded(g):
                released.append(g)
            else:
                self.buffer.add(g, front=True)
        return released, len(returned)
