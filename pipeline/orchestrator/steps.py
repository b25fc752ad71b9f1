"""The trainer's side of the orchestrator: step batches, the step record, staleness in the buffer.

Invariants (DESIGN §4, §6):
- step k's batch is the ``groups_per_step`` oldest buffered groups (ordered by group id), recorded
  in the log with the data-parallel rank of every sample and flushed before any trainer rank sees
  it; asking again for
  a recorded step returns the same samples (each rank gets its own share);
- before a step takes groups, buffered groups with ``trainer_version - min_version > max_staleness``
  are evicted (their slots freed, an ``EVICTED_STALE`` row logged);
- a trainer resuming from the checkpoint after step k forgets the steps recorded from k on: their
  groups go back to the front of the buffer, except those holding tokens of versions above k.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

import numpy as np

from pipeline.log_format import GroupOutcome
from pipeline.orchestrator.admission import Admission
from pipeline.orchestrator.batching import split_by_tokens
from pipeline.orchestrator.buffer import BufferedGroup, RolloutBuffer
from pipeline.orchestrator.config import OrchestratorConfig
from pipeline.orchestrator.links import batch_arrays
from pipeline.orchestrator.messages import Batch, GetBatch, Resume, encode
from pipeline.record import SampleBatch
from pipeline.rollout_log import RolloutLogWriter
from pipeline.transport import MessageServer

log = logging.getLogger(__name__)


class StepDesk:
    def __init__(self, cfg: OrchestratorConfig, staleness: int, server: MessageServer,
                 writer: RolloutLogWriter, buffer: RolloutBuffer, admission: Admission,
                 counts: Counter, group_rows: list, flush: Callable[[], None],
                 step_rows: dict[int, tuple[np.ndarray, np.ndarray]], trainer_version: int):
        self.cfg, self.staleness, self.server, self.writer = cfg, staleness, server, writer
        self.buffer, self.admission, self.counts = buffer, admission, counts
        self.group_rows, self.flush = group_rows, flush
        self.step_rows = step_rows
        """step -> (log rows, DP rank of each row) of every recorded step."""
        self.trainer_version = trainer_version
        """Optimizer steps the trainer has done (the step it asks for)."""
        self.waiting: dict[bytes, tuple[int, int, int | None]] = {}
        """trainer peer -> (step, dp_size, dp_rank) it waits for."""
        self._stale_checked_for = -1

    def on_get_batch(self, peer: bytes, msg: GetBatch) -> None:
        step, dp_size, dp_rank = msg.step, msg.dp_size, msg.dp_rank
        self.admission.version = msg.version
        if step in self.step_rows:
            rows, ranks = self.step_rows[step]
            self._send(peer, step, self.writer.read_samples(rows), ranks, dp_rank)
        else:
            self.trainer_version = max(self.trainer_version, step)
            self.waiting[peer] = (step, dp_size, dp_rank)

    def on_resume(self, peer: bytes, msg: Resume) -> None:
        """The trainer restarted from the checkpoint taken after ``step`` steps (DESIGN §6).

        Steps recorded at or after it are forgotten; their groups go back to the front of the
        buffer, except groups holding tokens of versions above ``step`` (weights that no longer
        exist), which are dropped and counted.
        """
        k = msg.step
        later = sorted((s for s in self.step_rows if s >= k), reverse=True)
        for s in later:
            rows, _ = self.step_rows.pop(s)
            batch = self.writer.read_samples(rows)
            gids = batch.columns["group_id"]
            for gid in list(dict.fromkeys(gids.tolist()))[::-1]:
                sel = np.flatnonzero(gids == gid)
                group = batch.take(sel)
                if int(group.columns["versions"].max()) > k:
                    self.admission.unkeep()
                    self.counts["dropped_future_version"] += 1
                    self.group_rows.append((gid, int(group.columns["attempt"][0]),
                                            GroupOutcome.EVICTED_STALE, int(rows[sel[0]]), len(sel),
                                            int(group.min_versions().min()), time.time()))
                    continue
                self.buffer.add(BufferedGroup(gid, int(group.columns["attempt"][0]), rows[sel],
                                              int(group.min_versions().min()), group.num_tokens, group),
                                front=True)
        self.trainer_version = k
        if self.admission.version is not None:  # else it opens once the trainer pushed weights
            self.admission.version = min(self.admission.version, k)
        self.waiting = {p: w for p, w in self.waiting.items() if w[0] < k}
        self.counts["trainer_resumes"] += 1
        log.info("trainer resumes at step %d: %d later step(s) returned to the buffer", k, len(later))

    def _drop_stale_buffered(self) -> None:
        for g in self.buffer.drop_stale(self.trainer_version, self.staleness):
            self.admission.unkeep()
            self.counts["dropped_stale_buffered"] += 1
            self.group_rows.append((g.group_id, g.attempt, GroupOutcome.EVICTED_STALE,
                                    int(g.rows[0]), len(g.rows), g.min_version, time.time()))

    def serve(self) -> None:
        if self.trainer_version != self._stale_checked_for:  # staleness only grows with it
            self._drop_stale_buffered()
            self._stale_checked_for = self.trainer_version
        for peer, (step, dp_size, dp_rank) in list(self.waiting.items()):
            if step in self.step_rows:  # another trainer rank asked first
                del self.waiting[peer]
                rows, ranks = self.step_rows[step]
                self._send(peer, step, self.writer.read_samples(rows), ranks, dp_rank)
                continue
            if len(self.buffer) < self.cfg.groups_per_step:
                continue
            # Oldest groups first; within the step in group order, so that a synchronous run whose
            # groups finished in another order still trains on an identical batch.
            groups = sorted(self.buffer.take(self.cfg.groups_per_step), key=lambda g: g.group_id)
            batch = SampleBatch.concat([g.batch for g in groups])
            rows = np.concatenate([g.rows for g in groups])
            lengths = batch.columns["prompt_len"] + batch.columns["completion_len"]
            ranks = split_by_tokens(lengths, dp_size)
            self.writer.append_steps(step, rows, ranks, self.trainer_version, time.time())
            self.flush()
            self.step_rows[step] = (rows, ranks)
            self.counts["steps_recorded"] += 1
            del self.waiting[peer]
            self._send(peer, step, batch, ranks, dp_rank)

    def _send(self, peer: bytes, step: int, batch: SampleBatch, ranks: np.ndarray,
              dp_rank: int | None) -> None:
        """Send a step's samples (only ``dp_rank``'s share if given) with their DP ranks."""
        if dp_rank is not None:
            sel = np.flatnonzero(ranks == int(dp_rank))
            batch, ranks = batch.take(sel), ranks[sel]
        arrays = batch_arrays(batch)
        arrays["dp_rank"] = ranks
        self.server.send(peer, *encode(Batch(step, self.trainer_version, arrays)))
        self.counts["batches_sent"] += 1
