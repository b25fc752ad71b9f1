"""Admission bound, leases and batching rules (`docs/architecture.md`, "Staleness, admission and
the policy clock"), as pure logic. Random interleavings with rollbacks: `test_policy_clock.py`."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from pipeline.orchestrator.admission import Admission, ResolvedSet
from pipeline.orchestrator.batching import split_by_cost
from pipeline.orchestrator.clock import PolicyClock


def admission(groups_per_step: int, max_async: int, lease_timeout_s: float) -> Admission:
    return Admission(groups_per_step, max_async, lease_timeout_s, PolicyClock(max_staleness=max_async))


def test_nothing_is_admitted_before_the_trainer_reports_a_version():
    a = admission(2, 1, 10)
    assert a.issue(b"g", 0.0) is None
    a.clock.trainer_reported(0)
    leases = [a.issue(b"g", 0.0) for _ in range(5)]
    assert [l.group_id for l in leases if l] == [0, 1, 2, 3]  # (1 + 0 + 1) * 2


def test_filtered_groups_free_their_slot_and_kept_ones_do_not():
    a = admission(1, 0, 10)
    a.clock.trainer_reported(0)
    l0 = a.issue(b"g", 0.0)
    assert a.issue(b"g", 0.0) is None
    a.accept(l0.group_id)
    a.resolve(l0.group_id, kept=False)  # filtered
    l1 = a.issue(b"g", 0.0)
    assert l1 is not None and l1.group_id == 1
    a.accept(1)
    a.resolve(1, kept=True)
    assert a.issue(b"g", 0.0) is None
    a.clock.trainer_reported(1)
    assert a.issue(b"g", 0.0).group_id == 2


def test_expired_lease_is_reissued_with_next_attempt_and_first_result_wins():
    a = admission(4, 0, 5)
    a.clock.trainer_reported(0)
    a.issue(b"g1", 0.0)
    assert a.expire(4.9) == []
    assert [l.group_id for l in a.expire(5.0)] == [0]
    in_flight = a.in_flight
    again = a.issue(b"g2", 6.0)
    assert (again.group_id, again.attempt) == (0, 1) and a.in_flight == in_flight
    assert a.classify_result(0) == "accept"  # the late attempt-0 result is still welcome
    a.accept(0)
    assert a.classify_result(0) == "duplicate"  # attempt 1 arriving later is a duplicate
    a.resolve(0, kept=True)
    assert a.classify_result(0) == "duplicate"
    assert a.classify_result(99) == "unleased"


def test_restore_reissues_unresolved_ids_below_the_cursor():
    a = admission(4, 1, 5)
    a.restore(resolved=[0, 1, 3, 6], kept=3, attempts={3: 2})
    a.clock.trainer_reported(0)
    got = [(l.group_id, l.attempt) for l in iter(lambda: a.issue(b"g", 0.0), None)]
    assert got[:3] == [(2, 0), (4, 0), (5, 0)]
    assert got[3][0] == 7
    assert a.kept + a.in_flight <= a.bound


def test_resolved_set_compacts_and_answers_membership():
    r = ResolvedSet()
    for g in [2, 0, 5, 1, 3]:
        r.add(g)
    assert r.low == 4 and r.above == {5}
    assert all(g in r for g in [0, 1, 2, 3, 5]) and 4 not in r and len(r) == 5 and r.max() == 5


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=60), st.integers(1, 8))
def test_token_split_assigns_every_sample_once_and_balances(tokens, dp):
    ranks = split_by_cost(np.array(tokens), dp)
    assert len(ranks) == len(tokens) and ranks.min() >= 0 and ranks.max() < dp
    loads = np.bincount(ranks, weights=tokens, minlength=dp)
    assert loads.max() - loads.min() <= max(tokens)
