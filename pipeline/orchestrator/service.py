"""The orchestrator process: admission, leases, scoring, the buffer and its durable log.

One single-threaded event loop owns all state (scoring runs in a thread pool and reports back to
the loop). Per turn it: receives and handles every waiting message; expires leases; resolves
scored groups (filter, staleness, store); flushes the rollout log once and only then acknowledges
the results that flush covers; grants work within the admission bound; serves a waiting step
batch; writes metrics.

Invariants (DESIGN §4, §6):
- each admitted group is resolved once: stored, filtered or dropped (by reason); a result is
  acknowledged only after the flush that covers its resolution;
- a group is stored only if ``trainer_version - min_version <= max_staleness``, checked when it is
  scored, while it waits in the buffer and again when a step takes it;
- a step's batch is recorded in the log (which samples, which DP rank) and flushed before the
  trainer sees it; asking again for a recorded step returns the same samples;
- restarting on the same run directory rebuilds everything from the log: resolved groups, the
  cursor, kept counts, the buffer (stored and not consumed), the step record. Groups leased but
  not stored before the crash are re-issued; nothing stored is stored again.
"""
from __future__ import annotations

import gc
import logging
import resource
import signal
import time
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import zmq

from pipeline.metrics import MetricsWriter
from pipeline.orchestrator.admission import Admission
from pipeline.orchestrator.buffer import BufferedGroup, RolloutBuffer
from pipeline.orchestrator.config import OrchestratorConfig
from pipeline.orchestrator.evaluation import Evaluator
from pipeline.orchestrator.members import GeneratorPool
from pipeline.orchestrator.links import batch_from_arrays, read_rendezvous, write_rendezvous
from pipeline.orchestrator.prompts import PromptSource
from pipeline.orchestrator.replay import LogFeeder
from pipeline.orchestrator.scoring import GROUP_FILTERS, AsyncScoring, Scorer
from pipeline.orchestrator.steps import StepDesk
from pipeline.record import RecordError, RecordSchema, SampleBatch
from pipeline.rollout_log import GroupOutcome, RolloutLogWriter
from pipeline.orchestrator.restore import restore_from_log
from pipeline.transport import MessageServer, TransportConfig, TransportError, load_or_create_secret
from pipeline.wire import Message

log = logging.getLogger(__name__)


class Orchestrator:
    def __init__(self, run_dir: Path, cfg: OrchestratorConfig, prompts: PromptSource,
                 scorer: Scorer, schema: RecordSchema, run_id: str = "run",
                 eval_prompts: PromptSource | None = None, replay_source: Path | None = None):
        cfg.validate()
        self.run_dir, self.cfg, self.prompts, self.schema = Path(run_dir), cfg, prompts, schema
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.staleness = cfg.staleness_limit()
        self.group_filter = GROUP_FILTERS[cfg.group_filter]
        self.admission = Admission(cfg.groups_per_step, cfg.max_async, cfg.lease_timeout_s)
        self.counts: Counter[str] = Counter()
        log_dir = self.run_dir / "rollouts"
        # The writer first: its start fences any stale writer, so the restore reads a final log.
        self.writer = RolloutLogWriter(log_dir, schema, run_id,
                                       {"group_size": cfg.group_size, "seed": cfg.seed},
                                       seal_interval_s=cfg.log_seal_interval_s,
                                       seal_bytes=cfg.log_seal_bytes)
        state = restore_from_log(log_dir)
        self.buffer = RolloutBuffer(cfg.memory_token_budget, self.writer.read_samples)
        self.admission.restore(state.resolved, len(state.buffered), state.attempts)
        for g in state.buffered:
            self.buffer.add(g)
        self.counts.update(state.outcome_counts)
        self.scoring = AsyncScoring(scorer, cfg.scorer_threads)
        self.evaluator = Evaluator(eval_prompts, scorer, schema) if eval_prompts else None
        self.feeder = LogFeeder(replay_source, set(state.resolved)) if replay_source else None
        self.server = _bind(self.run_dir, cfg.transport)
        self.epoch = uuid.uuid4().hex[:12]
        write_rendezvous(self.run_dir, {"address": self.server.address, "epoch": self.epoch})
        self.metrics = MetricsWriter(self.run_dir, "orchestrator")
        self.generators = GeneratorPool(cfg.generator_dead_after_s)
        self.to_ack: list[tuple[bytes, int, int, str]] = []
        self.group_rows: list[tuple] = []  # resolutions waiting for the next flush
        self.announced_version: int | None = None
        self.group_epoch: int | None = None
        self.desk = StepDesk(cfg, self.staleness, self.server, self.writer, self.buffer, self.admission,
                             self.counts, self.group_rows, self._flush, state.step_rows,
                             state.last_trainer_version)
        self.stopping = False
        self._last_flush = self._last_metrics = self._last_expiry = time.monotonic()
        self._ingested_tokens = self._ingested_total = 0
        self._write_metrics(time.monotonic())
        log.info("orchestrator epoch %s at %s (restored %d resolved groups, %d buffered, %d steps)",
                 self.epoch, self.server.address, len(state.resolved), len(state.buffered),
                 len(state.step_rows))

    # -- loop -----------------------------------------------------------------------------
    def run(self, duration_s: float | None = None) -> None:
        """Serve until SIGTERM/SIGINT (or for ``duration_s``), then flush and close."""
        end = None if duration_s is None else time.monotonic() + duration_s
        # The loop allocates many short-lived containers per message and no long-lived cycles:
        # freeze what start-up built and collect young objects less often.
        gc.freeze()
        gc.set_threshold(20_000, 50, 50)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        try:
            while not self.stopping and (end is None or time.monotonic() < end):
                self.turn()
        finally:
            self.close()

    def turn(self) -> None:
        # Sleep in the socket poll, but never past the flush that pending acknowledgements await.
        poll_s = self.cfg.flush_interval_s if self.to_ack else 0.05
        got = self.server.recv(poll_s)
        while got is not None:
            self.handle(*got)
            got = self.server.recv(0)
        now = time.monotonic()
        if now - self._last_expiry >= 0.1:
            self.counts["lease_expired"] += len(self.admission.expire(time.time()))
            self._reap_dead()
            self._last_expiry = now
        self._resolve_scored()
        if self.to_ack and (now - self._last_flush >= self.cfg.flush_interval_s or len(self.to_ack) > 64):
            self._flush_and_ack()
        if self.feeder is not None:
            self._feed_from_log()
        else:
            self._grant_work()
        self.desk.serve()
        if self.evaluator is not None and self.evaluator.round is not None:
            self.evaluator.send_work(self.server, list(self.generators))
        if now - self._last_metrics >= self.cfg.metrics_interval_s:
            self._write_metrics(now)

    def handle(self, peer: bytes, msg: Message) -> None:
        try:
            handler = {"hello": self._on_hello, "want": self._on_want, "result": self._on_result,
                       "members": self._on_members, "regroup": self._on_regroup,
                       "get_batch": self.desk.on_get_batch, "version": self._on_version,
                       "resume": self.desk.on_resume, "eval_request": self._on_eval_request,
                       "eval_result": self._on_eval_result, "weights": self._on_weights,
                       "finish": self._on_finish}[msg.kind]
        except KeyError:
            self.counts["unknown_kind"] += 1
            return
        self.generators.seen(peer)
        try:
            handler(peer, msg)
        except (KeyError, TypeError, ValueError) as exc:  # well-signed but nonsensical content
            self.counts["bad_request"] += 1
            log.warning("bad %s from %r: %s", msg.kind, peer, exc)

    # -- generators ------------------------------------------------------------------------
    def _on_hello(self, peer: bytes, msg: Message) -> None:
        if self.generators.hello(peer):  # restarted: the old process's leases never come back
            self.counts["leases_released"] += self.admission.release_holder(peer)
        if self.group_epoch is not None:  # it must join the weight group before taking weights
            self.server.send(peer, "regroup", {"epoch": self.group_epoch})
        if self.announced_version is not None:
            self.server.send(peer, "update", {"version": self.announced_version})

    def _on_want(self, peer: bytes, msg: Message) -> None:
        self.generators.set_credit(peer, msg.meta, self.epoch)

    def _on_members(self, peer: bytes, msg: Message) -> None:
        """The trainer asks which generators are alive (to build the weight group)."""
        self._reap_dead()
        self.server.send(peer, "members", {"members": self.generators.members()})

    def _on_regroup(self, peer: bytes, msg: Message) -> None:
        """The trainer rebuilt the weight group (epoch in meta): every generator must join it."""
        self.group_epoch = int(msg.meta["epoch"])
        for gen in self.generators:
            self.server.send(gen, "regroup", {"epoch": self.group_epoch})

    def _reap_dead(self) -> None:
        for peer in self.generators.reap():
            self.counts["generators_lost"] += 1
            self.counts["leases_released"] += self.admission.release_holder(peer)
            log.warning("generator %r silent for %.0fs: its leases are re-issued", peer,
                        self.cfg.generator_dead_after_s)

    def _grant_work(self) -> None:
        """One group at a time to each generator with credit in turn, so none is starved."""
        now = time.time()
        self.admission.loaded_floor = self.generators.loaded_floor()
        grants: dict[bytes, tuple[list, list]] = {}
        progress = True
        while progress:
            progress = False
            for peer, gen in self.generators.items():
                if gen.credit <= 0:
                    continue
                lease = self.admission.issue(peer, now)
                if lease is None:
                    break
                prompt = self.prompts.for_group(lease.group_id)
                items, prompts = grants.setdefault(peer, ([], []))
                items.append([lease.group_id, lease.attempt, prompt.prompt_id, self.cfg.group_size])
                prompts.append(prompt.token_ids)
                gen.credit -= 1
                gen.granted += 1
                progress = True
        for peer, (items, prompts) in grants.items():
            self.server.send(peer, "work", {"epoch": self.epoch, "version": self.admission.effective_version,
                                            "items": items},
                             {"prompt_ids": np.concatenate(prompts),
                              "prompt_len": np.array([len(p) for p in prompts], np.int32)})

    def _feed_from_log(self) -> None:
        """Replay: keep two steps' worth of recorded groups buffered, as generators would."""
        while len(self.buffer) < 2 * self.cfg.groups_per_step:
            nxt = self.feeder.next_group()
            if nxt is None:
                if self.desk.waiting and not self.counts["replay_exhausted"]:
                    self.counts["replay_exhausted"] += 1
                    log.error("the replay source has no more groups; the trainer waits for step(s) %s",
                              sorted(w[0] for w in self.desk.waiting.values()))
                return
            gid, group = nxt
            self.admission.resolve(gid, kept=True)
            self._store(gid, int(group.columns["attempt"][0]), group)

    def _on_result(self, peer: bytes, msg: Message) -> None:
        gid, attempt = int(msg.meta["group_id"]), int(msg.meta["attempt"])
        if "credit" in msg.meta:
            self.generators.set_credit(peer, msg.meta["credit"], self.epoch)
        verdict = self.admission.classify_result(gid)
        if verdict != "accept":
            self.counts[verdict] += 1
            if verdict == "unleased" or gid in self.admission.resolved:
                self.to_ack.append((peer, gid, attempt, verdict))
            return
        try:
            batch = batch_from_arrays(msg.arrays, self.schema)
            self._check_group(batch, gid, attempt)
        except RecordError as exc:
            self.counts["invalid_result"] += 1
            log.warning("invalid result for group %d from %r: %s", gid, peer, exc)
            self.to_ack.append((peer, gid, attempt, "invalid"))
            return
        self.admission.accept(gid)
        self._ingested_tokens += batch.num_tokens
        self._ingested_total += batch.num_tokens
        self.scoring.submit((gid, attempt, peer), batch, self.prompts.for_group(gid))

    def _check_group(self, batch: SampleBatch, gid: int, attempt: int) -> None:
        c = batch.columns
        if len(batch) != self.cfg.group_size:
            raise RecordError(f"{len(batch)} samples, group size is {self.cfg.group_size}")
        if (c["group_id"] != gid).any() or (c["attempt"] != attempt).any():
            raise RecordError("samples carry another group id or attempt than the message")
        if not np.array_equal(np.sort(c["sample_index"]), np.arange(len(batch))):
            raise RecordError("sample indices are not 0..G-1")
        prompt = self.prompts.for_group(gid)
        if (c["prompt_id"] != prompt.prompt_id).any():
            raise RecordError(f"prompt id differs from the group's prompt {prompt.prompt_id}")
        if ((c["prompt_len"] != len(prompt.token_ids)).any()
                or not np.array_equal(c["prompt_ids"].reshape(len(batch), -1),
                                      np.broadcast_to(prompt.token_ids, (len(batch), len(prompt.token_ids))))):
            raise RecordError("prompt tokens differ from the issued prompt")

    # -- resolution ------------------------------------------------------------------------
    def _resolve_scored(self) -> None:
        for (gid, attempt, peer), group, rewards, err in self.scoring.completed():
            if err is not None:
                log.warning("scoring group %d failed: %s", gid, err)
                self._resolve(gid, attempt, GroupOutcome.DROPPED_INVALID, None, peer, "score_error")
                continue
            group = _with_rewards(group, rewards)
            if not self.group_filter(rewards):
                self._resolve(gid, attempt, GroupOutcome.FILTERED, group, peer, "filtered")
            elif self.desk.trainer_version - int(group.min_versions().min()) > self.staleness:
                self._resolve(gid, attempt, GroupOutcome.DROPPED_STALE, group, peer, "dropped_stale")
            else:
                self._resolve(gid, attempt, GroupOutcome.STORED, group, peer, "stored")

    def _resolve(self, gid: int, attempt: int, outcome: GroupOutcome, group: SampleBatch | None,
                 peer: bytes, reason: str) -> None:
        kept = outcome == GroupOutcome.STORED
        if kept:
            self._store(gid, attempt, group)
        else:  # not stored: first_row -1
            n, min_v = (len(group), int(group.min_versions().min())) if group is not None else (0, -1)
            self.group_rows.append((gid, attempt, outcome, -1, n, min_v, time.time()))
        self.admission.resolve(gid, kept)
        self.counts[reason] += 1
        self.to_ack.append((peer, gid, attempt, reason))

    def _store(self, gid: int, attempt: int, group: SampleBatch) -> None:
        """Append a kept group to the log (row of its resolution included) and to the buffer."""
        rows = self.writer.append_samples(group)
        min_v = int(group.min_versions().min())
        self.buffer.add(BufferedGroup(gid, attempt, rows, min_v, group.num_tokens, group))
        self.group_rows.append((gid, attempt, GroupOutcome.STORED, int(rows[0]), len(group), min_v,
                                time.time()))

    def _flush(self) -> None:
        """Write the pending group resolutions and make everything appended durable."""
        if self.group_rows:
            self.writer.append_groups(*map(np.array, zip(*self.group_rows)))
            self.group_rows.clear()
        self.writer.flush()

    def _flush_and_ack(self) -> None:
        self._flush()
        self._last_flush = time.monotonic()
        by_peer: dict[bytes, list] = {}
        for peer, gid, attempt, outcome in self.to_ack:
            by_peer.setdefault(peer, []).append([gid, attempt, outcome])
        for peer, groups in by_peer.items():
            self.server.send(peer, "ack", {"groups": groups})
        self.to_ack.clear()

    # -- trainer ---------------------------------------------------------------------------
    def _on_version(self, peer: bytes, msg: Message) -> None:
        self.admission.version = int(msg.meta["version"])

    def _on_eval_request(self, peer: bytes, msg: Message) -> None:
        if self.evaluator is None:
            self.counts["eval_unavailable"] += 1
            return
        self.evaluator.start(int(msg.meta["step"]), int(msg.meta["version"]))
        self.evaluator.send_work(self.server, list(self.generators))

    def _on_eval_result(self, peer: bytes, msg: Message) -> None:
        if self.evaluator is None:
            return
        summary = self.evaluator.on_result(peer, msg, self.counts)
        if summary is not None:
            self.metrics.log("eval", **summary)

    def _on_weights(self, peer: bytes, msg: Message) -> None:
        self.announced_version = int(msg.meta["version"])
        for gen in self.generators:
            self.server.send(gen, "update", {"version": self.announced_version})

    def _on_finish(self, peer: bytes, msg: Message) -> None:
        for gen in self.generators:
            self.server.send(gen, "stop", {})
        self.stopping = True

    # -- metrics and shutdown -----------------------------------------------------------------
    def _write_metrics(self, now: float) -> None:
        dt = now - self._last_metrics
        a = self.admission
        self.metrics.log(
            "orchestrator", generators=len(self.generators), admitted=a.next_group_id, kept=a.kept, in_flight=a.in_flight,
            bound=a.bound, version=a.version, trainer_version=self.desk.trainer_version,
            buffer_groups=len(self.buffer), buffer_spilled=self.buffer.spilled,
            buffer_memory_tokens=self.buffer.memory_tokens, leases=len(a.leases),
            reissued=a.reissued_total, cpu_s=_cpu_seconds(), ingested_tokens=self._ingested_total,
            ingest_tokens_per_s=self._ingested_tokens / max(dt, 1e-9),
            **{f"count_{k}": v for k, v in self.counts.items()},
            **{f"frames_dropped_{k}": v for k, v in self.server.dropped.items()})
        self._ingested_tokens = 0
        self._last_metrics = now

    def close(self) -> None:
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


def _bind(run_dir: Path, cfg: TransportConfig) -> MessageServer:
    """Listen where the previous incarnation listened if possible, so peers reconnect by themselves."""
    key = load_or_create_secret(run_dir)
    if cfg.port == 0:
        try:
            prev = int(read_rendezvous(run_dir, 0.0)["address"].rsplit(":", 1)[1])
            return MessageServer(key, replace(cfg, port=prev))
        except (TransportError, ValueError, KeyError, zmq.ZMQError):
            pass
    return MessageServer(key, cfg)


def _with_rewards(batch: SampleBatch, rewards: np.ndarray) -> SampleBatch:
    cols = dict(batch.columns)
    cols["reward"] = rewards.astype(np.float32)
    return SampleBatch(cols, batch.schema, validate=False)
