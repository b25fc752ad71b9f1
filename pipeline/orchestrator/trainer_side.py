"""The orchestrator's trainer side: step batches, staleness eviction, rollbacks, evaluations.

`TrainerSide` is a part of `pipeline.orchestrator.service.Orchestrator` (its only user), kept in a
module of its own: the handlers of the messages trainer ranks send (`GetBatch`, `Resume`,
`TrainerVersion`, `EvalRequest`) and the per-turn serving of step batches. It runs on the
orchestrator's single event loop and uses its state (clock, admission, buffer, step desk, log).

Invariants it keeps (with the service's):
- before any step takes groups, every buffered group is checked against the current staleness
  bound once per trainer step (`clock.is_stale`), and a stale one is released as
  ``EVICTED_STALE`` with a second row in the log (its admission slot freed);
- a step's batch is recorded in the log (which samples, which DP rank) and flushed before any
  rank sees it; asking again for a recorded step returns the same samples (`StepDesk`);
- a rollback to the checkpoint after step k forgets the steps recorded from k on and releases
  every group holding tokens of a version above k as ``DROPPED_ROLLBACK`` (not in a replay).

Example: a trainer resumes from the checkpoint after step 6 while steps 6 and 7 were recorded:
their groups go back to the front of the buffer, and those among them (and among the buffered
ones) with a token of version 7 or 8 are released; the rest are served again as step 6.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pipeline.protocol import messages as m
from pipeline.orchestrator.buffer import BufferedGroup
from pipeline.rollout_log.writer import GroupOutcome

if TYPE_CHECKING:
    from collections import Counter

    from pipeline.metrics import MetricsWriter
    from pipeline.orchestrator.admission import Admission
    from pipeline.orchestrator.bounds import RunBounds
    from pipeline.orchestrator.config import OrchestratorConfig
    from pipeline.orchestrator.buffer import RolloutBuffer
    from pipeline.orchestrator.clock import PolicyClock
    from pipeline.orchestrator.evaluation import Evaluator
    from pipeline.protocol.transport import MessageServer
    from pipeline.orchestrator.members import GeneratorPool
    from pipeline.orchestrator.replay import LogFeeder
    from pipeline.orchestrator.steps import StepDesk

log = logging.getLogger("pipeline.orchestrator.service")


class TrainerSide:
    """Mixed into `Orchestrator`; the attributes below are the orchestrator's."""

    admission: "Admission"
    bounds: "RunBounds"
    cfg: "OrchestratorConfig"
    buffer: "RolloutBuffer"
    clock: "PolicyClock"
    counts: "Counter[str]"
    desk: "StepDesk"
    evaluator: "Evaluator | None"
    feeder: "LogFeeder | None"
    generators: "GeneratorPool"
    metrics: "MetricsWriter"
    server: "MessageServer"
    group_rows: list[tuple]
    _stale_checked_for: int

    def _release(self, g: BufferedGroup, outcome: GroupOutcome, reason: str) -> None:
        """A stored group leaves unconsumed: its admission slot is freed, a second row logged."""
        self.admission.unkeep()
        self.counts[reason] += 1
        self.group_rows.append((g.group_id, g.attempt, outcome, int(g.rows[0]), len(g.rows),
                                g.min_version, time.time()))

    def _on_get_batch(self, peer: bytes, msg: m.GetBatch) -> None:
        samples = self.cfg.groups_per_step * self.cfg.group_size
        if msg.dp_size > samples:
            self._bad_message(peer, msg.KIND, f"dp_size {msg.dp_size}: a step has {samples} samples")
            return
        self.clock.trainer_at_step(msg.step, msg.version)
        reply = self.desk.request(peer, msg)
        if reply is not None:
            self._send_batch(peer, reply)

    def _serve_steps(self) -> None:
        if self.clock.trainer_step != self._stale_checked_for:  # staleness only grows with it
            for g in self.buffer.drop(lambda g: self.clock.is_stale(g.min_version)):
                self._release(g, GroupOutcome.EVICTED_STALE, "dropped_stale_buffered")
            self._stale_checked_for = self.clock.trainer_step
        replies, recorded = self.desk.serve(self.clock.trainer_step)
        if recorded:
            self._flush()  # the step record is durable before any rank sees the step
            self.counts["steps_recorded"] += 1
        for peer, reply in replies:
            self._send_batch(peer, reply)

    def _send_batch(self, peer: bytes, batch: m.Batch) -> None:
        self._send(peer, batch)
        self.counts["batches_sent"] += 1

    def _on_resume(self, peer: bytes, msg: m.Resume) -> None:
        """The trainer restarted from the checkpoint taken after ``msg.step`` steps: a rollback.

        Steps recorded at or after it are forgotten; their groups go back to the front of the
        buffer, and every group (those and the buffered ones) holding tokens of a version above
        the checkpoint (weights that no longer exist) is released as ``DROPPED_ROLLBACK`` (not in
        a replay, whose groups' versions belong to the recorded run).
        """
        k = msg.step
        self.clock.trainer_resumed(k)

        def discarded(g: BufferedGroup) -> bool:
            if self.feeder is not None:  # replay: recorded versions name the source run's weights
                return False
            return int(self.buffer.samples(g).columns["versions"].max()) > k

        released, returned = self.desk.roll_back(k, discarded)
        for g in released:
            self._release(g, GroupOutcome.DROPPED_ROLLBACK, "dropped_rollback")
        self._stale_checked_for = -1
        self.counts["trainer_resumes"] += 1
        log.info("trainer resumes at step %d: %d group(s) of later steps forgotten; %d group(s) released "
                 "as dropped_rollback", k, returned, len(released))

    def _on_version(self, peer: bytes, msg: m.TrainerVersion) -> None:
        self.clock.trainer_reported(msg.version)

    def _on_eval_request(self, peer: bytes, msg: m.EvalRequest) -> None:
        if self.evaluator is None:
            self.counts["eval_unavailable"] += 1
            return
        self.evaluator.start(msg.step, msg.version)
        self.evaluator.send_work(self.server, list(self.generators))

    def _on_eval_result(self, peer: bytes, msg: m.EvalResult) -> None:
        if self.evaluator is None:
            return
        summary = self.evaluator.on_result(peer, msg, self.counts,
                                           lambda batch: self.bounds.check(batch, self.clock))
        if summary is not None:
            self.metrics.log("eval", **summary)
