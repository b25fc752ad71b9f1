"""The orchestrator process: admission, leases, scoring, the buffer and its durable log.

One single-threaded event loop owns all state (scoring runs in a thread pool and reports back to
the loop). Per turn it: receives and handles every waiting message (results wait, and are
checked as one batch once the flush is due: `pipeline.orchestrator.ingest`); expires leases;
resolves scored groups (filter, staleness, store); flushes the rollout log once and only then
acknowledges the results that flush covers; grants work within the admission bound (once
`generator_side.GRANT_MIN` slots of a generator are free or the flush window ends:
`pipeline.orchestrator.generator_side`); serves a waiting step batch; writes metrics.

Invariants (`docs/architecture.md`, "Staleness, admission and the policy clock", "Crash resume"):
- each admitted group is resolved once: stored, filtered or dropped (by reason); a result is
  acknowledged only after the flush that covers its resolution;
- every version fact lives in the policy clock (`pipeline.orchestrator.clock`), changed only by the
  handlers of the typed messages that report it;
- a group is stored only if it is not stale (`clock.is_stale`), checked when it is scored and
  again, for every buffered group, whenever the trainer's step advances, before a step takes any;
- a result holding tokens of weights a rollback discarded (`clock.rolled_back`) is not stored but
  re-issued (a new attempt regenerates it); stored groups of such weights (buffered, or of the
  forgotten steps) are released as ``DROPPED_ROLLBACK``;
- a step's batch is recorded in the log (which samples, which DP rank) and flushed before the
  trainer sees it; asking again for a recorded step returns the same samples;
- generators come and go while the run goes on (`pipeline.orchestrator.members`): a ``hello`` is a
  join (or a restart), a ``leave`` returns the leaver's leases at once, a silent one is lost; each
  is one ``membership`` record in the metrics stream, and so is each weight regroup;
- no message ends the loop: a message of a kind its sender's role may not send
  (`pipeline.protocol.roles`), a malformed one, or one whose handler raises is counted
  (``bad_message``) and answered with `Error`; a result's values are checked against what the run
  knows (`pipeline.orchestrator.bounds`) before it is scored or stored;
- a dataset's rows with a ``data_source`` are reported by source: each ``orchestrator`` record has
  ``reward_mean/source/<data_source>``, the mean reward of that source's groups scored since the last;
- restarting on the same run directory rebuilds everything from the log: resolved groups, the
  cursor, kept counts, the buffer (stored and not consumed), the step record. Groups leased but
  not stored before the crash are re-issued; nothing stored is stored again.
"""
from __future__ import annotations

import gc
import logging
import resource
import signal
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline.metrics import MetricsWriter
from pipeline.protocol import messages as m
from pipeline.orchestrator.admission import Admission
from pipeline.orchestrator.batching import StepCost
from pipeline.orchestrator.bounds import RunBounds
from pipeline.orchestrator.buffer import RolloutBuffer
from pipeline.orchestrator.clock import PolicyClock
from pipeline.orchestrator.config import OrchestratorConfig
from pipeline.orchestrator.evaluation import Evaluator
from pipeline.orchestrator.generator_side import GeneratorSide
from pipeline.orchestrator.ingest import ResultIngest
from pipeline.protocol.links import bind_server, write_rendezvous
from pipeline.orchestrator.members import GeneratorPool
from pipeline.orchestrator.prompts import PromptSource
from pipeline.orchestrator.replay import LogFeeder
from pipeline.orchestrator.restore import restore_from_log
from pipeline.orchestrator.scoring import GROUP_FILTERS, AsyncScoring, Scorer, Scoring
from pipeline.orchestrator.steps import StepDesk
from pipeline.orchestrator.trainer_side import TrainerSide
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.roles import may_send
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.rollout_log.writer import RolloutLogWriter
from pipeline.run_files import EVAL_ANSWERS_FILE, ROLLOUTS_DIR
from pipeline.protocol.wire import Message

log = logging.getLogger(__name__)


class Orchestrator(TrainerSide, GeneratorSide, ResultIngest):
    """The orchestrator's state and event loop; its trainer side (step batches, rollbacks,
    evaluations) is `pipeline.orchestrator.trainer_side`, its generator side (membership, credit,
    work grants) `pipeline.orchestrator.generator_side`, its result side (checks, resolution,
    log flush, acknowledgements) `pipeline.orchestrator.ingest`."""

    def __init__(self, run_dir: Path, cfg: OrchestratorConfig, prompts: PromptSource,
                 scorer: Scorer, schema: RecordSchema, bounds: RunBounds, run_id: str = "run",
                 eval_prompts: PromptSource | None = None, replay_source: Path | None = None,
                 scoring: Scoring | None = None, eval_samples: int = 0, step_cost: StepCost = StepCost()):
        """``scoring``: where groups are scored (default: ``AsyncScoring(scorer)`` in this process;
        `pipeline.scorers.pool.RemoteScoring` for scorer roles, which fill the fields of ``schema``
        generators do not send). ``bounds``: the model's vocabulary and experts. ``eval_samples``:
        sampled answers per held-out prompt (``eval.samples``). ``step_cost``: what a sample
        costs the trainer, balanced over its data-parallel ranks (`pipeline.orchestrator.batching`)."""
        cfg.validate()
        self.run_dir, self.cfg, self.prompts, self.schema = Path(run_dir), cfg, prompts, schema
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.group_filter = GROUP_FILTERS[cfg.group_filter]
        self.bounds = bounds
        self.counts: Counter[str] = Counter()
        self.source_rewards: defaultdict[str, np.ndarray] = defaultdict(lambda: np.zeros(2))
        """data_source -> (reward sum, samples) of the groups scored since the last metrics record."""
        log_dir = self.run_dir / ROLLOUTS_DIR
        # The writer first: its start fences any stale writer, so the restore reads a final log.
        self.writer = RolloutLogWriter(log_dir, schema, run_id,
                                       {"group_size": cfg.group_size, "seed": cfg.seed},
                                       seal_interval_s=cfg.log_seal_interval_s,
                                       seal_bytes=cfg.log_seal_bytes)
        state = restore_from_log(log_dir)
        self.clock = PolicyClock(cfg.staleness_limit(), trainer_step=state.last_trainer_step)
        self.admission = Admission(cfg.groups_per_step, cfg.max_async, cfg.lease_timeout_s, self.clock)
        self.buffer = RolloutBuffer(cfg.memory_token_budget, self.writer.read_samples)
        self.admission.restore(state.resolved, state.kept, state.attempts)
        for g in state.buffered:
            self.buffer.add(g)
        self.counts.update(state.outcome_counts)
        for damage in state.damage:
            log.warning("rollout log damage: %s", damage)
        self.scoring = scoring or AsyncScoring(scorer, cfg.scorer_threads)
        self.scoring.bind_clock(self.clock)  # scorer roles: a lagged teacher follows the policy
        # What generators send: the stored record less the fields scorer roles fill.
        self.result_schema = replace(schema, token_rewards=False, teacher_logprobs=False) \
            if scoring is not None else schema
        self.evaluator = Evaluator(eval_prompts, scorer, self.result_schema, samples=eval_samples,
                                   answers_path=self.run_dir / EVAL_ANSWERS_FILE) if eval_prompts else None
        self.feeder = LogFeeder(replay_source, set(state.resolved)) if replay_source else None
        self.server = bind_server(self.run_dir, cfg.transport)
        self.incarnation = uuid.uuid4().hex[:12]
        write_rendezvous(self.run_dir, {"address": self.server.address, "incarnation": self.incarnation})
        self.metrics = MetricsWriter(self.run_dir, "orchestrator")
        self.generators = GeneratorPool(cfg.generator_dead_after_s)
        self.to_ack: list[tuple[bytes, int, int, str]] = []
        self.results_waiting: list[tuple[bytes, int, int, SampleBatch, int]] = []  # the turn's groups: peer, id,
        # attempt, their message's samples, their place in it
        self._waiting_groups: set[int] = set()
        self.group_rows: list[tuple] = []  # resolutions waiting for the next flush
        self.weight_epoch: int | None = None  # the trainer's newest weight group
        self.announced_weight_epoch = 0  # the weight group the last announced version went into
        self.desk = StepDesk(cfg.groups_per_step, self.writer, self.buffer, state.step_rows, step_cost)
        self._stale_checked_for = -1
        self.stopping = False
        self._last_flush = self._last_metrics = self._last_expiry = time.monotonic()
        self._ingested_tokens = self._ingested_total = 0
        self._last_bad_log = 0.0
        self._write_metrics(time.monotonic())
        log.info("orchestrator incarnation %s at %s (restored %d resolved groups, %d buffered, %d steps)",
                 self.incarnation, self.server.address, len(state.resolved), len(state.buffered),
                 len(state.step_rows))

    # -- loop -----------------------------------------------------------------------------
    def run(self, duration_s: float | None = None, stop: threading.Event | None = None) -> None:
        """Serve until SIGTERM/SIGINT (or for ``duration_s``), then flush and close. ``stop``: the
        event the process's stop signals set since before start-up (`pipeline.apps.orchestrator`):
        a stop that arrived while the log was restored is taken now, after a whole start."""
        end = None if duration_s is None else time.monotonic() + duration_s
        # The loop allocates many short-lived containers per message and no long-lived cycles:
        # freeze what start-up built and collect young objects less often.
        gc.freeze()
        gc.set_threshold(20_000, 50, 50)
        stop = stop or threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        try:
            while not self.stopping and not stop.is_set() and (end is None or time.monotonic() < end):
                self.turn()
        finally:
            self.close()

    def turn(self) -> None:
        # Sleep in the socket poll, but never past the flush that pending acknowledgements await.
        window = self.cfg.flush_interval_s
        poll_s = window if self.to_ack or self.results_waiting else 0.05
        got = self.server.recv(poll_s)
        while got is not None:
            self.handle(*got)
            got = self.server.recv(0)
        now = time.monotonic()
        flush_due = now - self._last_flush >= window
        if flush_due:  # the results of the flush window, checked as one batch
            self._check_results()
        if now - self._last_expiry >= 0.1:
            self.counts["lease_expired"] += len(self.admission.expire(time.time()))
            self._reap_dead()
            self._last_expiry = now
        self._resolve_scored()
        if self.to_ack and (flush_due or len(self.to_ack) > 64):
            self._flush_and_ack()
        if self.feeder is not None:
            self._feed_from_log()
        elif flush_due or self._grant_due():
            self._grant_work()
        self._serve_steps()
        if self.evaluator is not None and self.evaluator.round is not None:
            self.evaluator.send_work(self.server, list(self.generators))
        if now - self._last_metrics >= self.cfg.metrics_interval_s:
            self._write_metrics(now)

    def handle(self, peer: bytes, raw: Message) -> None:
        """Decode a message into its record and dispatch it; a malformed, unknown or misdirected
        message is counted (``bad_message``) and answered with an `Error` naming the problem."""
        try:
            msg = m.decode(raw)
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise m.MessageError(raw.kind, "not a message the orchestrator takes")
            if raw.origin is None or not may_send(raw.origin.role, type(msg)):
                role = raw.origin.role if raw.origin else "an unstamped sender"
                raise m.MessageError(raw.kind, f"a {role} may not send it")
        except m.MessageError as exc:
            self._bad_message(peer, exc.kind, exc.detail)
            return
        self.generators.seen(peer)
        if self.results_waiting and type(msg) is not m.Result:  # effects in arrival order
            self._check_results()
        try:
            handler(peer, msg)
        except Exception as exc:  # no message ends the run: counted and answered like a malformed one
            self._handler_failed(peer, raw.kind, exc)

    def _handler_failed(self, peer: bytes, kind: str, exc: Exception) -> None:
        self.counts["handler_error"] += 1
        if self.counts["handler_error"] <= 10:
            log.error("handling %s from %r failed", kind, peer[:64], exc_info=exc)
        self._bad_message(peer, kind, f"could not be handled: {type(exc).__name__}: {exc}"[:500])

    def _bad_message(self, peer: bytes, kind: str, detail: str) -> None:
        self.counts["bad_message"] += 1
        now = time.monotonic()
        if now - self._last_bad_log >= 1.0:  # a flood of bad messages must not flood the log
            self._last_bad_log = now
            log.warning("bad message from %r: %s: %s (%d so far)", peer[:64], kind, detail,
                        self.counts["bad_message"])
        self.server.send(peer, *m.encode(m.Error(kind, detail)))

    @cached_property  # looked up once per received message
    def _handlers(self) -> dict[type, Callable]:
        return {m.Hello: self._on_hello, m.Leave: self._on_leave, m.Want: self._on_want, m.Result: self._on_result,
                m.ListMembers: self._on_members, m.Regroup: self._on_regroup,
                m.GetBatch: self._on_get_batch, m.TrainerVersion: self._on_version,
                m.Resume: self._on_resume, m.EvalRequest: self._on_eval_request,
                m.EvalResult: self._on_eval_result, m.WeightsAnnounced: self._on_weights,
                m.Finish: self._on_finish, m.StartProgress: self._on_start_progress}

    def _send(self, peer: bytes, msg) -> None:
        self.server.send(peer, *m.encode(msg))

    def _feed_from_log(self) -> None:
        """Replay: keep two steps' worth of recorded groups buffered, as generators would."""
        while len(self.buffer) < 2 * self.cfg.groups_per_step:
            nxt = self.feeder.next_group()
            if nxt is None:
                starved = self.desk.waiting and len(self.buffer) < self.cfg.groups_per_step
                if starved and not self.counts["replay_exhausted"]:
                    self.counts["replay_exhausted"] += 1
                    log.error("the replay source has no more groups; the trainer waits for step(s) %s",
                              sorted(req.step for req in self.desk.waiting.values()))
                return
            gid, group = nxt
            self.admission.resolve(gid, kept=True)
            self._store([(gid, int(group.columns["attempt"][0]), group, int(group.min_versions().min()))])

    def _on_weights(self, peer: bytes, msg: m.WeightsAnnounced) -> None:
        self.clock.weights_announced(msg.version)
        if msg.weight_epoch != self.announced_weight_epoch:  # the trainer switched to a newly formed weight group
            self.announced_weight_epoch = msg.weight_epoch
            self._membership("switch", None, epoch=msg.weight_epoch, version=msg.version)
        for gen in self.generators.listeners():
            self._send(gen, m.Update(msg.version, msg.weight_epoch))
        self.scoring.weights_announced(msg.version, msg.weight_epoch)

    def _on_finish(self, peer: bytes, msg: m.Finish) -> None:
        for gen in self.generators.listeners():
            self._send(gen, m.Stop())
        self.stopping = True

    # -- metrics and shutdown -----------------------------------------------------------------
    def _write_metrics(self, now: float) -> None:
        dt = now - self._last_metrics
        a, c = self.admission, self.clock
        self.metrics.log(
            "orchestrator", generators=len(self.generators), admitted=a.next_group_id, kept=a.kept, in_flight=a.in_flight,
            bound=a.bound, version=c.reported, admission_version=c.admission_version,
            trainer_step=c.trainer_step, rollback_epoch=c.rollback_epoch,
            buffer_groups=len(self.buffer), buffer_spilled=self.buffer.spilled,
            buffer_memory_tokens=self.buffer.memory_tokens, leases=len(a.leases),
            reissued=a.reissued_total, cpu_s=_cpu_seconds(), ingested_tokens=self._ingested_total,
            log_flush_seq=self.writer.seq,
            ingest_tokens_per_s=self._ingested_tokens / max(dt, 1e-9),
            **{f"count_{k}": v for k, v in self.counts.items()},
            **{f"frames_dropped_{k}": v for k, v in self.server.dropped.items()},
            **self.scoring.metrics(),
            **{f"reward_mean/source/{k}": total / n for k, (total, n) in self.source_rewards.items()})
        self.source_rewards.clear()
        self._ingested_tokens = 0
        self._last_metrics = now

    def close(self) -> None:
        self._check_results()
        self._resolve_scored()
        self._flush_and_ack()
        self._write_metrics(time.monotonic())
        self.scoring.close()
        if self.feeder is not None:
            self.feeder.close()
        self.writer.close()
        self.server.close()
        self.metrics.close()


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
