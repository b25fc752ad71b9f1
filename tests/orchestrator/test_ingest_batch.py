"""A turn's results are checked as one batch (`pipeline/orchestrator/ingest.py`): an orchestrator in
this process, driven turn by turn, with a real generator link over ZeroMQ. A bad result among good
ones is refused alone and the others are stored as sent; a result re-sent within the turn is
judged after the first; a `Result` of several groups is cut into its groups at arrival, a bad
group (or one whose columns disagree with the header) refused alone, a message past
``max_groups_per_result`` refused whole; freed slots are granted a few at a time
(`pipeline/orchestrator/generator_side.py`)."""
from __future__ import annotations

import functools
import time

import numpy as np

from pipeline.orchestrator.bounds import RunBounds
from pipeline.orchestrator.config import OrchestratorConfig
from pipeline.orchestrator.generator_side import GRANT_MIN
from pipeline.orchestrator.prompts import SyntheticPromptSource
from pipeline.orchestrator.scoring import Scoring, VerifierScorer, last_token_verifier
from pipeline.orchestrator.service import Orchestrator
from pipeline.protocol import messages as m
from pipeline.protocol.links import GeneratorLink, TrainerLink, WorkItem, batch_arrays
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.protocol.transport import TransportConfig
from pipeline.rollout_log.reader import RolloutLog
from support.loadgen import synthetic_group

SCHEMA = RecordSchema()
GROUPS = 6


def _orchestrator(run_dir, flush_interval_s=0.05, max_groups_per_result=16):
    cfg = OrchestratorConfig(group_size=4, groups_per_step=2, max_async=100, flush_interval_s=flush_interval_s,
                             transport=TransportConfig(max_groups_per_result=max_groups_per_result))
    return Orchestrator(run_dir, cfg, SyntheticPromptSource(vocab_size=1000), VerifierScorer(last_token_verifier),
                        SCHEMA, RunBounds(1000), run_id="t")


def _turns_until(orch, done, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the orchestrator did not get there in time"
        orch.turn()


def _granted_work(orch, link, n):
    trainer = TrainerLink(orch.run_dir, SCHEMA)
    trainer.report_version(0)  # opens admission
    link.send_want()
    items = []
    deadline = time.monotonic() + 20
    while len(items) < n:
        assert time.monotonic() < deadline, f"granted {len(items)} of {n} groups"
        orch.turn()
        items += [i for i in link.poll(0.01) if not isinstance(i, m.Stop)]
    trainer.close()
    return items[:n]


def _send_all(link, results):
    for item, batch in results:
        link.send(m.Result([[item.group_id, item.attempt]], None, batch_arrays(batch)))


def test_one_bad_result_in_a_turn_is_refused_alone_and_the_rest_stored_as_sent(tmp_path):
    orch = _orchestrator(tmp_path)
    link = GeneratorLink(tmp_path, 0, slots=GROUPS, schema=SCHEMA)
    try:
        items = _granted_work(orch, link, GROUPS)
        results = [(i, synthetic_group(i, 0, SCHEMA, 16, 32)) for i in items]
        bad_item, bad = results[2]
        cols = dict(bad.columns)
        cols["completion_ids"] = cols["completion_ids"].copy()
        cols["completion_ids"][5] = 1000  # beyond the vocabulary: only the run's bounds catch it
        results[2] = (bad_item, SampleBatch(cols, SCHEMA, validate=False))
        _send_all(link, results)
        time.sleep(0.2)  # every result waits in the socket: one turn drains them all
        _turns_until(orch, lambda: orch.counts["stored"] + orch.counts["invalid_result"] == GROUPS)
        assert orch.counts["invalid_result"] == 1 and orch.counts["stored"] == GROUPS - 1
        assert orch.counts["handler_error"] == 0
        _turns_until(orch, lambda: not orch.to_ack)
        deadline = time.monotonic() + 10
        while sum(link.outcomes.values()) < GROUPS and time.monotonic() < deadline:
            link.poll(0.05)
        assert link.outcomes == {"stored": GROUPS - 1, "invalid": 1}
    finally:
        orch.close()
        link.close()
    sent = {i.group_id: b for i, b in results if i.group_id != bad_item.group_id}
    with RolloutLog.open(tmp_path / "rollouts") as log:
        stored = SampleBatch.concat(list(log.iter_batches()))
    by_group = {int(g): stored.take(np.flatnonzero(stored.columns["group_id"] == g))
                for g in np.unique(stored.columns["group_id"])}
    assert set(by_group) == set(sent)
    for gid, batch in sent.items():  # the tokens stored are the tokens sent, byte for byte
        for name in ("completion_ids", "logprobs", "versions", "prompt_ids", "completion_len"):
            np.testing.assert_array_equal(by_group[gid].columns[name], batch.columns[name])


def test_a_result_resent_within_the_turn_counts_as_a_duplicate(tmp_path):
    orch = _orchestrator(tmp_path)
    link = GeneratorLink(tmp_path, 0, slots=2, schema=SCHEMA)
    try:
        item = _granted_work(orch, link, 1)[0]
        batch = synthetic_group(item, 0, SCHEMA, 16, 32)
        _send_all(link, [(item, batch), (item, batch)])
        time.sleep(0.2)
        _turns_until(orch, lambda: orch.counts["stored"] == 1 and orch.counts["duplicate"] == 1)
        assert orch.counts["invalid_result"] == 0 and orch.counts["handler_error"] == 0
    finally:
        orch.close()
        link.close()


def test_freed_slots_are_granted_once_grant_min_are_free(tmp_path):
    """The flush window (60 s here) never ends in the test: three results free three slots and
    bring no work; the fourth brings one `Work` of four groups."""
    orch = _orchestrator(tmp_path, flush_interval_s=60.0)
    link = GeneratorLink(tmp_path, 0, slots=8, schema=SCHEMA)
    try:
        items = _granted_work(orch, link, 8)
        gen = orch.generators.gens[b"gen-0"]
        assert GRANT_MIN == 4 and gen.granted == 8
        for item in items[:3]:
            link.queue_result(item, synthetic_group(item, 0, SCHEMA, 16, 32))
        link.send_results()
        _turns_until(orch, lambda: gen.credit == 3)
        assert gen.granted == 8 and not link.poll(0.2)
        link.queue_result(items[3], synthetic_group(items[3], 0, SCHEMA, 16, 32))
        link.send_results()
        _turns_until(orch, lambda: gen.granted == 12)
        granted = link.poll(5.0)
        assert len(granted) == 4 and {i.group_id for i in granted}.isdisjoint(i.group_id for i in items)
    finally:
        orch.close()
        link.close()


def _stored_by_group(run_dir) -> dict[int, SampleBatch]:
    with RolloutLog.open(run_dir / "rollouts") as log:
        stored = SampleBatch.concat(list(log.iter_batches()))
    return {int(g): stored.take(np.flatnonzero(stored.columns["group_id"] == g))
            for g in np.unique(stored.columns["group_id"])}


def _poisoned(batch, name, index, value):
    cols = {k: v.copy() for k, v in batch.columns.items()}
    cols[name][index] = value
    return SampleBatch(cols, SCHEMA, validate=False)


def _acks(link, n):
    deadline = time.monotonic() + 10
    while sum(link.outcomes.values()) < n and time.monotonic() < deadline:
        link.poll(0.05)
    return link.outcomes


def test_a_multi_group_result_is_cut_at_arrival_and_its_bad_groups_refused_alone(tmp_path):
    """One `Result` of 6 groups: group 2 holds a token beyond the vocabulary, group 4's samples
    carry another attempt than the header names for it; the 4 others are stored byte for byte."""
    orch = _orchestrator(tmp_path)
    link = GeneratorLink(tmp_path, 0, slots=GROUPS, schema=SCHEMA)
    try:
        items = _granted_work(orch, link, GROUPS)
        results = [(i, synthetic_group(i, 0, SCHEMA, 16, 32)) for i in items]
        results[2] = (items[2], _poisoned(results[2][1], "completion_ids", 5, 1000))
        results[4] = (items[4], _poisoned(results[4][1], "attempt", 1, items[4].attempt + 1))
        for item, batch in results:
            link.queue_result(item, batch)
        link.send_results()  # one message: 6 <= max_groups_per_result
        _turns_until(orch, lambda: orch.counts["stored"] + orch.counts["invalid_result"] == GROUPS)
        assert orch.counts["result_messages"] == 1 and orch.counts["result_groups"] == GROUPS
        assert orch.counts["invalid_result"] == 2 and orch.counts["stored"] == GROUPS - 2
        assert orch.counts["handler_error"] == 0 and orch.counts["bad_message"] == 0
        _turns_until(orch, lambda: not orch.to_ack)
        assert _acks(link, GROUPS) == {"stored": GROUPS - 2, "invalid": 2}
        assert set(link.unacked) == set()
    finally:
        orch.close()
        link.close()
    by_group = _stored_by_group(tmp_path)
    sent = {i.group_id: b for k, (i, b) in enumerate(results) if k not in (2, 4)}
    assert set(by_group) == set(sent)
    for gid, batch in sent.items():
        for name in ("completion_ids", "logprobs", "versions", "prompt_ids", "completion_len", "attempt"):
            np.testing.assert_array_equal(by_group[gid].columns[name], batch.columns[name])


def test_a_group_that_cannot_be_accepted_fails_alone_and_its_batch_is_scored_without_it(tmp_path):
    """One `Result` of 6 valid groups, scored together once checked; accepting group 3 fails (an
    error inside the orchestrator, not in the message): it is counted as a handler failure and
    the 5 others are accepted one by one, scored and stored byte for byte."""
    orch = _orchestrator(tmp_path)
    link = GeneratorLink(tmp_path, 0, slots=GROUPS, schema=SCHEMA)
    try:
        items = _granted_work(orch, link, GROUPS)
        results = [(i, synthetic_group(i, 0, SCHEMA, 16, 32)) for i in items]
        real_accept, broken = orch.admission.accept, items[3].group_id

        def accept(gid):
            if gid == broken:
                raise RuntimeError("admission broke")
            real_accept(gid)
        orch.admission.accept = accept
        for item, batch in results:
            link.queue_result(item, batch)
        link.send_results()
        _turns_until(orch, lambda: orch.counts["stored"] == GROUPS - 1)
        assert orch.counts["handler_error"] == 1 and orch.counts["invalid_result"] == 0
        _turns_until(orch, lambda: not orch.to_ack)
        assert _acks(link, GROUPS - 1)["stored"] == GROUPS - 1
    finally:
        orch.close()
        link.close()
    by_group = _stored_by_group(tmp_path)
    assert set(by_group) == {i.group_id for i in items} - {broken}
    for item, batch in results:
        if item.group_id != broken:
            for name in ("completion_ids", "logprobs", "versions", "prompt_ids", "completion_len"):
                np.testing.assert_array_equal(by_group[item.group_id].columns[name], batch.columns[name])
            want = [float(batch.tokens("completion_ids", k)[0] == batch.prompt(k)[-1]) for k in range(len(batch))]
            np.testing.assert_array_equal(by_group[item.group_id].columns["reward"], want)


def test_groups_whose_scoring_could_not_be_submitted_are_taken_again_not_held_forever(tmp_path):
    """Accepted groups whose submission for scoring fails (an error inside the orchestrator) were
    left "processing": never scored or resolved, a re-send refused as a duplicate, each holding an
    admission slot for the rest of the run. They go back to admission (to be issued again as the
    next attempt), so the generator's re-send of the unacknowledged results is taken and stored."""
    orch = _orchestrator(tmp_path)
    link = GeneratorLink(tmp_path, 0, slots=GROUPS, schema=SCHEMA)
    try:
        items = _granted_work(orch, link, GROUPS)
        real_submit = orch.scoring.submit_groups

        def submit_groups(*args):
            orch.scoring.submit_groups = real_submit  # fails once
            raise RuntimeError("scoring broke")
        orch.scoring.submit_groups = submit_groups
        for item in items:
            link.queue_result(item, synthetic_group(item, 0, SCHEMA, 16, 32))
        link.send_results()
        _turns_until(orch, lambda: orch.counts["handler_error"] == 1)
        assert not orch.admission.processing
        assert sorted(orch.admission.reissue) == sorted((i.group_id, i.attempt + 1) for i in items)

        def stored():
            link.poll(0.01)  # the link re-sends what was not acknowledged
            return orch.counts["stored"] == GROUPS
        _turns_until(orch, stored)
    finally:
        orch.close()
        link.close()
    assert set(_stored_by_group(tmp_path)) == {i.group_id for i in items}
    assert orch.counts.get("duplicate", 0) == 0


def test_a_batch_whose_submission_fails_midway_takes_again_only_the_groups_not_submitted(tmp_path):
    """Submitting one by one (`Scoring.submit_groups`'s default, which the scorer-process pool uses)
    failed at a batch's third group: the two submitted before it are scored and stored, and only the
    others go back to admission. Before, all went back, so the two were stored and then issued
    again: generated a second time and answered as duplicates."""
    orch = _orchestrator(tmp_path)
    link = GeneratorLink(tmp_path, 0, slots=GROUPS, schema=SCHEMA)
    try:
        items = _granted_work(orch, link, GROUPS)
        real_submit, calls = orch.scoring.submit, []

        def submit(key, group, prompt):
            calls.append(key[0])
            if len(calls) == 3:
                raise RuntimeError("scoring broke")
            real_submit(key, group, prompt)
        orch.scoring.submit = submit
        orch.scoring.submit_groups = functools.partial(Scoring.submit_groups, orch.scoring)
        for item in items:
            link.queue_result(item, synthetic_group(item, 0, SCHEMA, 16, 32))
        link.send_results()  # one message of the six groups
        _turns_until(orch, lambda: orch.counts["handler_error"] == 1)
        assert len(calls) == 3
        assert sorted(orch.admission.reissue) == sorted((i.group_id, i.attempt + 1) for i in items
                                                        if i.group_id not in calls[:2])

        def stored():
            link.poll(0.01)  # the link re-sends what was not acknowledged
            return orch.counts["stored"] == GROUPS
        _turns_until(orch, stored)
        assert not orch.admission.reissue
    finally:
        orch.close()
        link.close()
    assert set(_stored_by_group(tmp_path)) == {i.group_id for i in items}
    assert orch.counts.get("duplicate", 0) == 0 and orch.admission.reissued_total == 0


def test_a_result_cut_wrong_or_past_the_group_bound_is_refused_and_the_orchestrator_goes_on(tmp_path):
    """A 3-group `Result` with a bound of 2 is a bad message (an `Error`, nothing taken); one whose
    samples are not 2 groups of 4, or miss a column, refuses each of its groups as invalid; the
    same groups sent right afterwards are stored."""
    orch = _orchestrator(tmp_path, max_groups_per_result=2)
    link = GeneratorLink(tmp_path, 0, slots=4, schema=SCHEMA, cfg=TransportConfig(max_groups_per_result=2))
    try:
        items = _granted_work(orch, link, 3)
        groups = [synthetic_group(i, 0, SCHEMA, 16, 32) for i in items]
        pairs = [[i.group_id, i.attempt] for i in items]
        three = SampleBatch.concat(groups)
        link.send(m.Result(pairs, None, batch_arrays(three)))
        short = SampleBatch.concat(groups[:2]).take(range(7))  # 7 samples for 2 groups of 4
        link.send(m.Result(pairs[:2], None, batch_arrays(short)))
        no_logprobs = {k: v for k, v in batch_arrays(SampleBatch.concat(groups[1:])).items() if k != "logprobs"}
        link.send(m.Result(pairs[1:], None, no_logprobs))
        _turns_until(orch, lambda: orch.counts["invalid_result"] == 4)
        assert orch.counts["bad_message"] == 1 and orch.counts["result_messages"] == 2
        link.poll(0.5)
        assert link.errors == 1  # the Error answer to the 3-group message
        for item, batch in zip(items, groups):
            link.queue_result(item, batch)
        link.send_results()  # packed by the link's own bound: 2 + 1 groups
        _turns_until(orch, lambda: orch.counts["stored"] == 3)
        assert orch.counts["result_messages"] == 4 and orch.counts["handler_error"] == 0
    finally:
        orch.close()
        link.close()


def test_the_verifier_scores_each_sample_on_its_own_completion():
    """`VerifierScorer` hands the verifier each sample's completion tokens, whatever the lengths."""
    seen = []

    def verify(prompt, completion_ids):
        seen.append(completion_ids.copy())
        return float(len(completion_ids) + 0.5 * (completion_ids[0] == prompt.answer))
    group = synthetic_group(WorkItem(3, 0, 5, 5, np.arange(9, dtype=np.int32), 0), 0, SCHEMA, 1, 40)
    prompt = SyntheticPromptSource().load(5)
    rewards = VerifierScorer(verify).score(group, prompt)
    clen = group.columns["completion_len"]
    assert len(set(clen.tolist())) > 1 and rewards.dtype == np.float32
    for i in range(len(group)):
        np.testing.assert_array_equal(seen[i], group.tokens("completion_ids", i))
        assert rewards[i] == clen[i] + 0.5 * (group.tokens("completion_ids", i)[0] == prompt.answer)
