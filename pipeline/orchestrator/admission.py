"""Admission control and leases: which prompt group may be generated next, and by whom.

Invariants (`docs/architecture.md`, "Staleness, admission and the policy clock"):
- a new group is handed out only while ``kept + in_flight < (max_async + version + 1) * groups_per_step``
  (so that after the hand-out ``kept + in_flight <= bound``), ``version`` being the policy clock's
  ``admission_version``; ``kept`` counts groups kept after filtering and not released since
  (evicted as stale, dropped by a rollback), consumed ones included, so ``kept >= 0``;
  ``in_flight`` counts groups leased, queued for re-issue or received-but-unresolved; nothing is
  handed out while the clock's admission version is None;
- after a rollback lowers the bound, ``kept + in_flight`` may exceed it: the excess drains as
  groups resolve and is never topped up (a re-issue leases a group already in flight, no new one);
- every lease records the rollback epoch it was issued in (`lease_rollback_epoch`), so a result is
  checked against the rollbacks that happened since;
- a lease not returned within ``lease_timeout_s`` is re-issued with ``attempt + 1``; its group stays
  in flight, so expiry never opens extra admission;
- each group is resolved exactly once: the first valid result of any attempt of a leased, unresolved
  group is accepted; every later result of that group is a duplicate.

Worked example: ``groups_per_step = 4, max_async = 1``. With version 0 the bound is (1 + 0 + 1) * 4 = 8:
8 groups may be kept or in flight before the trainer finishes step 0. After the generators load
version 1 the bound becomes 12, letting 4 more groups in. A filtered group leaves ``kept`` unchanged,
so its slot is reused and a strict filter cannot deadlock the run.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

from pipeline.orchestrator.clock import UNKNOWN_ROLLBACK_EPOCH, PolicyClock


@dataclass
class Lease:
    group_id: int
    attempt: int
    holder: bytes
    deadline: float
    rollback_epoch: int
    """The policy clock's rollback epoch when it was issued."""


class ResolvedSet:
    """Group ids resolved so far, stored as a watermark plus the sparse set above it."""

    def __init__(self) -> None:
        self.low = 0  # every id < low is resolved
        self.above: set[int] = set()

    def add(self, gid: int) -> None:
        if gid >= self.low:
            self.above.add(gid)
            while self.low in self.above:
                self.above.discard(self.low)
                self.low += 1

    def __contains__(self, gid: int) -> bool:
        return gid < self.low or gid in self.above

    def __len__(self) -> int:
        return self.low + len(self.above)

    def max(self) -> int:
        return max(self.above) if self.above else self.low - 1


class Admission:
    """Lease book-keeping and the admission bound for one orchestrator incarnation."""

    def __init__(self, groups_per_step: int, max_async: int, lease_timeout_s: float, clock: PolicyClock):
        if groups_per_step < 1 or max_async < 0 or lease_timeout_s <= 0:
            raise ValueError("need groups_per_step >= 1, max_async >= 0, lease_timeout_s > 0")
        self.groups_per_step = groups_per_step
        self.max_async = max_async
        self.lease_timeout_s = lease_timeout_s
        self.clock = clock
        self.issued: dict[int, tuple[int, int]] = {}
        """group -> (attempt, rollback epoch) of its latest lease in this incarnation."""
        self.kept = 0
        self.next_group_id = 0
        self.leases: dict[int, Lease] = {}
        self.processing: set[int] = set()
        self.resolved = ResolvedSet()
        self.reissue: deque[tuple[int, int]] = deque()
        self.reissued_total = 0

    # -- restore ------------------------------------------------------------------------------
    def restore(self, resolved: Iterable[int], kept: int, attempts: dict[int, int]) -> None:
        """Rebuild from the log: resolved groups, how many are kept, last attempt per group.

        Unresolved ids below the largest resolved one were leased before the restart: they are
        re-issued first (attempt + 1); the cursor continues after the largest resolved id.
        """
        ids = sorted(set(resolved))
        for gid in ids:
            self.resolved.add(gid)
        self.kept = kept
        self.next_group_id = ids[-1] + 1 if ids else 0
        for gid in range(self.resolved.low, self.next_group_id):
            if gid not in self.resolved:
                self.reissue.append((gid, attempts.get(gid, -1) + 1))

    # -- admission ----------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.leases) + len(self.processing) + len(self.reissue)

    @property
    def bound(self) -> int:
        v = self.clock.admission_version
        if v is None:
            return 0
        return (self.max_async + v + 1) * self.groups_per_step

    def capacity(self) -> int:
        """How many new groups may be handed out now (re-issues take no new capacity)."""
        return max(0, self.bound - self.kept - self.in_flight)

    def issue(self, holder: bytes, now: float) -> Lease | None:
        """Lease the next group (a re-issue first) to ``holder``, or None if admission is closed."""
        if self.clock.admission_version is None:
            return None
        if self.reissue:
            gid, attempt = self.reissue.popleft()
            self.reissued_total += 1
        elif self.capacity() > 0:
            gid, attempt = self.next_group_id, 0
            self.next_group_id += 1
        else:
            return None
        lease = Lease(gid, attempt, holder, now + self.lease_timeout_s, self.clock.rollback_epoch)
        self.leases[gid] = lease
        self.issued[gid] = (attempt, lease.rollback_epoch)
        return lease

    def lease_rollback_epoch(self, gid: int, attempt: int) -> int:
        """The rollback epoch the result ``(gid, attempt)`` was leased in (`UNKNOWN_ROLLBACK_EPOCH`
        for an attempt leased by an earlier incarnation or superseded by a re-issue)."""
        issued = self.issued.get(gid)
        return issued[1] if issued is not None and issued[0] == attempt else UNKNOWN_ROLLBACK_EPOCH

    def expire(self, now: float) -> list[Lease]:
        """Move leases past their deadline to the re-issue queue."""
        expired = [lease for lease in self.leases.values() if lease.deadline <= now]
        for lease in expired:
            del self.leases[lease.group_id]
            self.reissue.append((lease.group_id, lease.attempt + 1))
        return expired

    def release_holder(self, holder: bytes) -> int:
        """Re-issue every lease of a holder known to be gone (a restarted generator)."""
        gone = [lease for lease in self.leases.values() if lease.holder == holder]
        for lease in gone:
            del self.leases[lease.group_id]
            self.reissue.append((lease.group_id, lease.attempt + 1))
        return len(gone)

    # -- results ------------------------------------------------------------------------------
    def classify_result(self, gid: int) -> str:
        """``accept`` | ``duplicate`` (already resolved or being processed) | ``unleased``."""
        if gid in self.resolved or gid in self.processing:
            return "duplicate"
        if gid in self.leases or any(g == gid for g, _ in self.reissue):
            return "accept"
        return "unleased"

    def accept(self, gid: int) -> None:
        if self.leases.pop(gid, None) is None:
            self.reissue = deque((g, a) for g, a in self.reissue if g != gid)
        self.processing.add(gid)

    def reject_processing(self, gid: int, attempt: int) -> None:
        """A received result turned out invalid: the group goes back to be re-issued."""
        self.processing.discard(gid)
        self.reissue.append((gid, attempt + 1))

    def resolve(self, gid: int, kept: bool) -> None:
        self.processing.discard(gid)
        self.issued.pop(gid, None)
        self.resolved.add(gid)
        if kept:
            self.kept += 1

    def unkeep(self) -> None:
        """A kept group released later (stale in the buffer, dropped by a rollback) frees its slot."""
        if self.kept < 1:
            raise ValueError("unkeep without a kept group")
        self.kept -= 1

