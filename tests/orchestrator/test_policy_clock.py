"""The policy clock and admission driven together through random event sequences (hypothesis
state machine): announce / load / report / step / rollback / issue / receive / keep / filter /
regenerate / unkeep / expire / release / generator loss / rejoin, with every invariant of `pipeline.orchestrator.clock`
and `pipeline.orchestrator.admission` checked after every event against a plain model kept here.
"""
from __future__ import annotations

import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pipeline.orchestrator.admission import Admission
from pipeline.orchestrator.clock import UNKNOWN_ROLLBACK_EPOCH, PolicyClock, is_stale, staleness

GENERATORS = [b"gen-0", b"gen-1", b"gen-2"]
GROUPS_PER_STEP, MAX_ASYNC = 2, 1


class ClockAndAdmission(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = PolicyClock(max_staleness=MAX_ASYNC)
        self.adm = Admission(GROUPS_PER_STEP, MAX_ASYNC, lease_timeout_s=1.0, clock=self.clock)
        self.now = 0.0
        # the model: facts as the events stated them, nothing derived by the code under test
        self.reported: int | None = None
        self.step = 0
        self.live: dict[bytes, int | None] = {}
        self.discarded: set[bytes] = set()  # live generators holding weights a rollback discarded
        self.rollbacks: list[int] = []  # rollback point of each rollback, in order
        self.kept = 0
        self.unresolved: dict[int, tuple[int, int]] = {}  # admitted group -> (attempt, rollbacks at lease)
        self.next_new = 0

    # -- trainer --------------------------------------------------------------------------------
    @rule()
    def announce(self):
        self.clock.weights_announced(self.step)

    @rule(data=st.data())
    def load(self, data):
        if not self.live:
            return
        peer = data.draw(st.sampled_from(sorted(self.live)))
        v = data.draw(st.one_of(st.none(), st.integers(0, self.step + 1)))
        self.clock.generator_loaded(peer, v)
        self.live[peer] = v
        if v is not None and self.rollbacks and v <= self.rollbacks[-1]:
            self.discarded.discard(peer)

    @rule(data=st.data())
    def report(self, data):
        v = data.draw(st.integers(0, self.step))
        self.clock.trainer_reported(v)
        self.reported = v

    @rule()
    def step_done(self):
        v = self.step + 1
        self.clock.trainer_at_step(v, v)
        self.step, self.reported = v, v

    @rule(data=st.data())
    def rollback(self, data):
        k = data.draw(st.integers(0, self.step))
        self.clock.trainer_resumed(k)
        self.rollbacks.append(k)
        self.step = k
        if self.reported is not None:
            self.reported = min(self.reported, k)
        self.discarded |= {p for p, v in self.live.items() if v is not None and v > k}

    # -- generators -----------------------------------------------------------------------------
    @rule(peer=st.sampled_from(GENERATORS))
    def join(self, peer):
        self.clock.generator_joined(peer)
        self._released(self.adm.release_holder(peer))
        self.live[peer] = None
        self.discarded.discard(peer)

    @rule(peer=st.sampled_from(GENERATORS))
    def lose(self, peer):
        self.clock.generator_lost(peer)
        self._released(self.adm.release_holder(peer))
        self.live.pop(peer, None)
        self.discarded.discard(peer)

    def _released(self, n: int) -> None:
        assert n >= 0  # released leases stay in flight (queued for re-issue): nothing to model

    # -- admission ------------------------------------------------------------------------------
    @rule(peer=st.sampled_from(GENERATORS))
    def issue(self, peer):
        before = self.adm.kept + self.adm.in_flight
        bound = self.adm.bound
        queued = len(self.adm.reissue)
        lease = self.adm.issue(peer, self.now)
        if lease is None:
            assert self.clock.admission_version is None or (queued == 0 and before >= bound)
            return
        if lease.group_id == self.next_new and lease.attempt == 0:  # a new group
            assert queued == 0 and before < bound, "a new group admitted at or over the bound"
            assert self.adm.kept + self.adm.in_flight <= bound
            self.next_new += 1
        else:  # a re-issue: no new capacity taken
            assert self.adm.kept + self.adm.in_flight == before
        self.unresolved[lease.group_id] = (lease.attempt, len(self.rollbacks))

    @rule(data=st.data())
    def receive(self, data):
        """A result arrives and goes to scoring (still in flight)."""
        if not self.adm.leases:
            return
        gid = data.draw(st.sampled_from(sorted(self.adm.leases)))
        assert self.adm.classify_result(gid) == "accept"
        self.adm.accept(gid)
        assert self.adm.classify_result(gid) == "duplicate"

    @rule(data=st.data(), kept=st.booleans())
    def resolve(self, data, kept):
        """Scoring done: stored (kept) or filtered."""
        if not self.adm.processing:
            return
        gid = data.draw(st.sampled_from(sorted(self.adm.processing)))
        self.adm.resolve(gid, kept=kept)
        del self.unresolved[gid]
        self.kept += kept

    @rule(data=st.data())
    def regenerate(self, data):
        """A scored result held discarded weights: its group is re-issued with a new attempt."""
        if not self.adm.processing:
            return
        gid = data.draw(st.sampled_from(sorted(self.adm.processing)))
        self.adm.reject_processing(gid, self.unresolved[gid][0])

    @precondition(lambda self: self.kept > 0)
    @rule()
    def unkeep(self):
        self.adm.unkeep()  # a stored group evicted as stale or dropped by a rollback
        self.kept -= 1

    @rule()
    def expire(self):
        self.now += 2.0
        self.adm.expire(self.now)

    @rule(data=st.data())
    def result_of_discarded_weights(self, data):
        """A result's tokens are judged against the rollbacks since its lease was issued."""
        if not self.unresolved:
            return
        gid = data.draw(st.sampled_from(sorted(self.unresolved)))
        attempt, seen = self.unresolved[gid]
        versions = np.array(data.draw(st.lists(st.integers(0, self.step + 2), min_size=1, max_size=4)))
        epoch = self.adm.lease_rollback_epoch(gid, attempt)
        assert epoch == seen  # every lease here was issued by this incarnation
        expected = any(int(versions.max()) > k for k in self.rollbacks[seen:])
        assert self.clock.rolled_back(epoch, versions) == expected
        # work of an earlier incarnation is judged against every rollback seen
        assert self.clock.rolled_back(UNKNOWN_ROLLBACK_EPOCH, versions) == any(
            int(versions.max()) > k for k in self.rollbacks)

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def kept_and_in_flight_are_counted_exactly(self):
        assert self.adm.kept == self.kept >= 0
        assert self.adm.in_flight == len(self.unresolved)

    @invariant()
    def admission_version_is_what_everyone_holds(self):
        v = self.clock.admission_version
        if self.reported is None or self.discarded & set(self.live):
            assert v is None
        else:
            loaded = [x for x in self.live.values() if x is not None]
            assert v == min([self.reported, *loaded])
        bound = (MAX_ASYNC + v + 1) * GROUPS_PER_STEP if v is not None else 0
        assert self.adm.bound == bound

    @invariant()
    def trainer_step_and_staleness(self):
        assert self.clock.trainer_step == self.step
        assert self.clock.rollback_epoch == len(self.rollbacks)
        for mv in (self.step - 2, self.step - 1, self.step):
            assert self.clock.is_stale(mv) == (self.step - mv > MAX_ASYNC) == is_stale(self.step, mv, MAX_ASYNC)
            assert staleness(self.step, mv) == self.step - mv


ClockAndAdmission.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_clock_and_admission_keep_their_invariants = ClockAndAdmission.TestCase


def test_worked_example_of_the_clock_docstring():
    c = PolicyClock(max_staleness=1)
    c.trainer_reported(0)
    c.generator_loaded(b"g", 0)
    assert c.admission_version == 0
    for s in range(1, 7):
        c.trainer_at_step(s, s - 1)
    c.generator_loaded(b"g", 6)
    c.trainer_reported(6)
    assert c.trainer_step == 6 and c.is_stale(4) and not c.is_stale(5)
    c.trainer_resumed(4)
    assert (c.trainer_step, c.reported, c.rollback_epoch) == (4, 4, 1)
    assert c.admission_version is None  # g still holds the discarded version 6
    c.generator_loaded(b"g", 4)
    assert c.admission_version == 4
    assert c.rolled_back(0, np.array([3, 5])) and not c.rolled_back(0, np.array([2, 4]))
    assert not c.rolled_back(1, np.array([5]))  # leased after the rollback: the new version 5
