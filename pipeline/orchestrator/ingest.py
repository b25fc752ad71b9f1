"""The orchestrator's result side: a turn's groups checked in a few batches, then scored, resolved,
logged in one flush and acknowledged in one pass.

`ResultIngest` is a part of `pipeline.orchestrator.service.Orchestrator` (its only user), kept in
a module of its own: the handler of `Result` and everything a result goes through until its
acknowledgement. It runs on the orchestrator's single event loop and uses its state (admission,
clock, bounds, scoring, buffer, log writer, server).

A `Result` carries one or more groups (at most ``transport.max_groups_per_result``; more is a
bad message, answered with `Error`): their (group id, attempt) pairs in its header, their samples
in that order, ``group_size`` each. At arrival it is cut into per-group entries: each group is
classified (``duplicate`` / ``unleased`` / ``accept``); the message's layout
(`SampleBatch.check_layout`: names, dtypes, lengths) and its sample count (groups x
``group_size``) are checked once, and each accepted group waits in ``results_waiting`` with its
message's one batch and its place in it (a message that cannot be cut refuses each accepted group
as ``invalid``). At the end of the drain (or before any other kind of message is handled, or when
`RESULTS_PER_CHECK` groups wait, or when a waiting group arrives again) the waiting groups are
checked in arrival order, in batches: a message's run of two or more groups as one batch (a row
view of its frames: no copy), a stretch of groups that came alone as one concatenation. Each
batch's values (`SampleBatch.check_values`), its samples against their leases and header pairs
(`check_groups`: a group whose ``group_id``/``attempt`` columns differ from its pair is refused)
and the run's bounds (`RunBounds.check`) are checked in one vectorised pass each. If a batch fails
anywhere, each of its groups is checked alone, so a bad one is named and refused (``invalid``) and
the others, those of its own message included, go on as if each had been checked on arrival.
A checked batch's groups are submitted for scoring together (`Scoring.submit_groups`: an inline
verifier scores the batch's samples in one pass, a failure in it is re-scored group by group).
Classification, verdicts, leases, resolution and acknowledgements are per group; the credit, the
MAC, the counter, the role check and the layout check are per message.

Invariants:
- the order of effects is the arrival order: results are checked before any other message is
  handled, so a result accepted in a turn is accepted before a later `Leave`, `Resume` or
  version report, exactly as if it had been handled alone;
- a batch of groups passes the batched checks iff each group passes them alone (values are
  checked by element, by minimum or maximum, and a sample's versions only across the samples'
  own boundaries, which concatenation and a message's run keep);
- a result is acknowledged only after the flush that covers its resolution (`_flush_and_ack`:
  one journal entry for every resolution and stored group since the last, then one `Ack` per
  peer);
- the groups a turn stores are appended to the log in one `RolloutLogWriter.append_samples`, in
  the order they were resolved, before the flush that acknowledges them.

Worked example: a flush window (20 ms) brings 24 groups of 8 x 1K-token samples from two
generators, which answered `Work` messages of 4 groups each with `Result`s of 4 groups (~400 KB):
6 messages received, authenticated, decoded, role-checked and layout-checked (~150 us each of the
orchestrator's main thread, where 24 one-group messages cost 24 of each), 6 batches of 32 samples
/ 33K tokens checked in place (value, group and bounds checks: 18 vectorised passes, no copy;
24 one-group messages were concatenated, ~2.4 MB copied, and checked in 3 passes), 6 batches
scored (one verifier pass each, handing back 24 row views), one journal flush and one `Ack` per
generator.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from pipeline.orchestrator.buffer import BufferedGroup
from pipeline.orchestrator.prompts import check_groups
from pipeline.orchestrator.scoring import SubmitFailed, with_rewards
from pipeline.protocol import messages as m
from pipeline.protocol.record import RecordError
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.rollout_log.writer import GroupOutcome

if TYPE_CHECKING:
    from collections import Counter

    from pipeline.orchestrator.admission import Admission
    from pipeline.orchestrator.bounds import RunBounds
    from pipeline.orchestrator.buffer import RolloutBuffer
    from pipeline.orchestrator.clock import PolicyClock
    from pipeline.orchestrator.config import OrchestratorConfig
    from pipeline.orchestrator.prompts import PromptSource
    from pipeline.orchestrator.scoring import Scoring
    from pipeline.protocol.record import RecordSchema
    from pipeline.rollout_log.writer import RolloutLogWriter

log = logging.getLogger("pipeline.orchestrator.service")

RESULTS_PER_CHECK = 64
"""Waiting groups are checked once this many wait (bounds what a turn holds unchecked)."""


class ResultIngest:
    """Mixed into `Orchestrator`; the attributes below are the orchestrator's, and so are the
    methods ``_credit``, ``_handler_failed`` and ``_send`` it calls."""

    admission: "Admission"
    bounds: "RunBounds"
    buffer: "RolloutBuffer"
    cfg: "OrchestratorConfig"
    clock: "PolicyClock"
    counts: "Counter[str]"
    group_filter: Callable[[np.ndarray], bool]
    prompts: "PromptSource"
    result_schema: "RecordSchema"
    scoring: "Scoring"
    source_rewards: dict
    writer: "RolloutLogWriter"
    group_rows: list[tuple]
    to_ack: list[tuple[bytes, int, int, str]]
    results_waiting: list[tuple[bytes, int, int, SampleBatch, int]]
    _waiting_groups: set[int]
    _ingested_tokens: int
    _ingested_total: int
    _last_flush: float

    # -- arrival -------------------------------------------------------------------------------
    def _on_result(self, peer: bytes, msg: m.Result) -> None:
        """Cut a message's groups into per-group entries (row views of its one batch, its layout
        checked once) and classify each; the accepted ones wait for the turn's batched checks."""
        groups = msg.groups
        bound = self.cfg.transport.max_groups_per_result
        if len(groups) > bound:
            self._bad_message(peer, msg.KIND, f"{len(groups)} groups exceed max_groups_per_result ({bound})")
            return
        if msg.credit is not None:
            self._credit(peer, msg.credit)
        self.counts["result_messages"] += 1
        self.counts["result_groups"] += len(groups)
        if not self._waiting_groups.isdisjoint(gid for gid, _ in groups):  # a re-send within the turn:
            self._check_results()  # the first is judged first
        accepted = []
        for i, (gid, attempt) in enumerate(groups):
            verdict = self.admission.classify_result(gid)
            if verdict == "accept":
                accepted.append(i)
                continue
            self.counts[verdict] += 1
            if verdict == "unleased" or gid in self.admission.resolved:
                self.to_ack.append((peer, gid, attempt, verdict))
        if not accepted:
            return
        size = self.cfg.group_size
        samples = SampleBatch(msg.arrays, self.result_schema, validate=False)
        try:
            samples.check_layout()
            if len(samples) != len(groups) * size:
                raise RecordError(f"{len(samples)} samples, {len(groups)} group(s) of size {size}")
        except RecordError as exc:  # the message cannot be cut into its groups: each is refused
            for i in accepted:
                self._refuse(peer, *groups[i], exc)
            return
        for i in accepted:
            gid, attempt = groups[i]
            self.results_waiting.append((peer, gid, attempt, samples, i))
            self._waiting_groups.add(gid)
        if len(self.results_waiting) >= RESULTS_PER_CHECK:
            self._check_results()

    # -- the turn's batch ----------------------------------------------------------------------
    def _check_results(self) -> None:
        """Check the waiting groups (module docstring), in arrival order: each message's run of
        two or more accepted groups as one batch (row views of it: no copy), each stretch of
        lone groups as one concatenation; each valid group is accepted and scored, each invalid
        one refused."""
        waiting, self.results_waiting = self.results_waiting, []
        self._waiting_groups.clear()
        start = 0
        while start < len(waiting):
            end = start + 1
            if _continues(waiting, end):
                while _continues(waiting, end):
                    end += 1
            else:
                while end < len(waiting) and not _continues(waiting, end + 1):
                    end += 1
            self._check_together(waiting[start:end])
            start = end

    def _check_together(self, entries: list[tuple[bytes, int, int, SampleBatch, int]]) -> None:
        size = self.cfg.group_size
        first, last = entries[0], entries[-1]
        if first[3] is last[3] and last[4] - first[4] == len(entries) - 1:  # one message's run
            together = first[3].rows(first[4] * size, (last[4] + 1) * size)
        else:
            together = SampleBatch.concat([_group_rows(samples, i, size) for *_, samples, i in entries])
        try:
            together.check_values()
            check_groups(together, [(gid, attempt, self.prompts.for_group(gid)) for _, gid, attempt, *_ in entries],
                         size)
            self.bounds.check(together, self.clock)
        except Exception:  # noqa: BLE001 - find and name the bad one(s): each is checked alone
            for peer, gid, attempt, samples, i in entries:
                self._check_alone(peer, gid, attempt, _group_rows(samples, i, size))
            return
        self._accept_checked(entries, together)

    def _check_alone(self, peer: bytes, gid: int, attempt: int, group: SampleBatch) -> None:
        try:
            group.check_values()
            check_groups(group, [(gid, attempt, self.prompts.for_group(gid))], self.cfg.group_size)
            self.bounds.check(group, self.clock)
        except RecordError as exc:
            self._refuse(peer, gid, attempt, exc)
            return
        except Exception as exc:  # no message ends the run: counted and answered like a malformed one
            self._handler_failed(peer, m.Result.KIND, exc)
            return
        self._accept(peer, gid, attempt, group)

    def _refuse(self, peer: bytes, gid: int, attempt: int, exc: RecordError) -> None:
        """A group's samples are invalid: counted, logged, acknowledged ``invalid`` (its lease
        stays, so it is re-issued when the lease expires)."""
        self.counts["invalid_result"] += 1
        log.warning("invalid result for group %d from %r: %s", gid, peer, exc)
        self.to_ack.append((peer, gid, attempt, "invalid"))

    def _accept_checked(self, entries: list[tuple[bytes, int, int, SampleBatch, int]], together: SampleBatch) -> None:
        """Accept a checked batch's groups and submit them for scoring in one
        `Scoring.submit_groups` (views of the batch); if looking up or accepting one fails, each
        is accepted alone (`_accept`: the failing one counted, the others go on)."""
        try:
            prompts = [self.prompts.for_group(gid) for _, gid, *_ in entries]
            for _, gid, *_ in entries:
                self.admission.accept(gid)
        except Exception:  # noqa: BLE001 - found and counted group by group (accepting is idempotent)
            for (peer, gid, attempt, *_), group in zip(entries, together.groups(len(entries))):
                self._accept(peer, gid, attempt, group)
            return
        tokens = together.num_tokens
        self._ingested_tokens += tokens
        self._ingested_total += tokens
        try:
            self.scoring.submit_groups([(gid, attempt, peer) for peer, gid, attempt, *_ in entries], together, prompts)
        except Exception as exc:  # no message ends the run (checked after its handler returned)
            submitted = exc.submitted if isinstance(exc, SubmitFailed) else 0  # those are answered
            self._handler_failed(entries[0][0], m.Result.KIND, exc)
            for _, gid, attempt, *_ in entries[submitted:]:
                self.admission.reject_processing(gid, attempt)  # never scored: generated again

    def _accept(self, peer: bytes, gid: int, attempt: int, group: SampleBatch) -> None:
        try:
            prompt = self.prompts.for_group(gid)
            self.admission.accept(gid)
        except Exception as exc:  # no message ends the run (checked after its handler returned)
            self._handler_failed(peer, m.Result.KIND, exc)
            return
        tokens = group.num_tokens
        self._ingested_tokens += tokens
        self._ingested_total += tokens
        try:
            self.scoring.submit((gid, attempt, peer), group, prompt)
        except Exception as exc:
            self._handler_failed(peer, m.Result.KIND, exc)
            self.admission.reject_processing(gid, attempt)  # never scored: generated again

    # -- resolution ----------------------------------------------------------------------------
    def _resolve_scored(self) -> None:
        kept: list[tuple[int, int, SampleBatch, int]] = []  # stored together once resolved
        for (gid, attempt, peer), group, rewards, err in self.scoring.completed():
            if err is not None:
                log.warning("scoring group %d failed: %s", gid, err)
                self._resolve(gid, attempt, GroupOutcome.DROPPED_INVALID, peer, "score_error")
                continue
            if self.clock.rolled_back(self.admission.lease_rollback_epoch(gid, attempt), group.columns["versions"]):
                self.admission.reject_processing(gid, attempt)  # regenerated by a new attempt
                self.counts["rollback_regenerated"] += 1
                self.to_ack.append((peer, gid, attempt, "rolled_back"))
                continue
            group = with_rewards(group, rewards)
            source = getattr(self.prompts.for_group(gid).answer, "data_source", "")  # a dataset row's source
            if source:
                self.source_rewards[source] += np.array([rewards.sum(), len(rewards)])
            min_v = int(group.min_versions().min())
            if not self.group_filter(rewards):
                self._resolve(gid, attempt, GroupOutcome.FILTERED, peer, "filtered", group, min_v)
            elif self.clock.is_stale(min_v):
                self._resolve(gid, attempt, GroupOutcome.DROPPED_STALE, peer, "dropped_stale", group, min_v)
            else:
                self._resolve(gid, attempt, GroupOutcome.STORED, peer, "stored")
                kept.append((gid, attempt, group, min_v))
        if kept:
            self._store(kept)

    def _resolve(self, gid: int, attempt: int, outcome: GroupOutcome, peer: bytes, reason: str,
                 group: SampleBatch | None = None, min_v: int = -1) -> None:
        """Resolve a group; one not stored gets its row now (first_row -1), a stored one when
        `_store` appends it (in the same turn, before the flush)."""
        kept = outcome == GroupOutcome.STORED
        if not kept:
            n = len(group) if group is not None else 0
            self.group_rows.append((gid, attempt, outcome, -1, n, min_v, time.time()))
        self.admission.resolve(gid, kept)
        self.counts[reason] += 1
        self.to_ack.append((peer, gid, attempt, reason))

    def _store(self, kept: list[tuple[int, int, SampleBatch, int]]) -> None:
        """Append kept groups (group id, attempt, samples, oldest version) to the log in one
        append, their resolutions' rows included, and to the buffer."""
        rows = self.writer.append_samples(*(group for _, _, group, _ in kept))
        at, now = 0, time.time()
        for gid, attempt, group, min_v in kept:
            n = len(group)
            self.buffer.add(BufferedGroup(gid, attempt, rows[at:at + n], min_v, group.num_tokens, group))
            self.group_rows.append((gid, attempt, GroupOutcome.STORED, int(rows[at]), n, min_v, now))
            at += n

    # -- durability and acknowledgement --------------------------------------------------------
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
            self._send(peer, m.Ack(groups))
        self.to_ack.clear()


def _continues(waiting: list[tuple[bytes, int, int, SampleBatch, int]], k: int) -> bool:
    """Whether waiting group ``k`` is the group after ``k - 1`` in the same message."""
    return 0 < k < len(waiting) and waiting[k][3] is waiting[k - 1][3] and waiting[k][4] == waiting[k - 1][4] + 1


def _group_rows(samples: SampleBatch, i: int, size: int) -> SampleBatch:
    """Group ``i`` of a message's samples (the batch itself when it holds one group)."""
    return samples if len(samples) == size else samples.rows(i * size, (i + 1) * size)
