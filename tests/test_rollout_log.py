"""The rollout log writer: round trip, kill -9 durability, SWMR live reads, refusals, tolerance."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pipeline.log_format import (
    CorruptSegmentError, GroupOutcome, LogError, LogLockedError, NewerSchemaError, SchemaMismatchError, filesystem_type,
    segment_name)
from pipeline.log_reader import RolloutLog
from pipeline.record import RecordSchema, SampleBatch
from pipeline.rollout_log import RolloutLogWriter
from rollout_data import assert_batches_equal, make_batch

REPO = Path(__file__).resolve().parents[1]
SCHEMA = RecordSchema(token_rewards=True)

schemas = st.builds(
    RecordSchema, token_rewards=st.booleans(), teacher_logprobs=st.booleans(),
    routed_experts=st.none() | st.tuples(st.integers(1, 3), st.integers(1, 3)),
    sampling_mask_k=st.none() | st.integers(1, 4))


@given(schema=schemas, sizes=st.lists(st.integers(0, 12), min_size=1, max_size=6),
       flushes=st.lists(st.booleans(), min_size=6, max_size=6), seed=st.integers(0, 2**31),
       long=st.booleans())
@settings(max_examples=25, deadline=None)
def test_round_trip_sample_batches_through_the_log(schema, sizes, flushes, seed, long):
    clen = (1, 15_000) if long else (1, 40)  # long: crosses 64k-token chunks and regrowths
    batches = [make_batch(schema, seed + i, n, first_group=100 * i, completion_len=clen)
               for i, n in enumerate(sizes)]
    expected = SampleBatch.concat(batches)
    perm = np.random.default_rng(seed).permutation(len(expected))
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp) / "rollouts"
        with RolloutLogWriter(log_dir, schema, "prop", {"k": 1}) as w:
            start = 0
            for b, flush in zip(batches, flushes):
                rows = w.append_samples(b)
                np.testing.assert_array_equal(rows, np.arange(start, start + len(b)))
                start += len(b)
                if flush:
                    w.flush()
            assert w.num_rows == len(expected)
            assert_batches_equal(w.read_samples(np.arange(len(expected))), expected)  # live file
            assert_batches_equal(w.read_samples(perm), expected.take(perm))
        with RolloutLog.open(log_dir.parent) as log:
            assert log.num_samples == len(expected) and log.meta == {"k": 1}
            assert_batches_equal(log.read(np.arange(len(expected))), expected)
            assert_batches_equal(log.read(perm), expected.take(perm))
            got = list(log.iter_batches(batch_size=5))
            assert all(1 <= len(g) <= 5 for g in got)
            if got:
                assert_batches_equal(SampleBatch.concat(got), expected)


WRITER_SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{repo!r}, {tests!r}]
    import numpy as np
    from pipeline.record import RecordSchema
    from pipeline.rollout_log import RolloutLogWriter
    from rollout_data import make_batch
    log_dir, base, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    schema = RecordSchema(token_rewards=True)
    w = RolloutLogWriter(log_dir, schema, "killme", {{"base": base}})
    print("ready", w.first_row, flush=True)
    i = 0
    while True:
        if mode == "step":
            sys.stdin.readline()
        b = make_batch(schema, base + i, 8, first_group=base + 2 * i)
        rows = w.append_samples(b)
        w.append_groups(np.array([base + 2 * i, base + 2 * i + 1]), 0, 0, rows[[0, 4]], 4, 0, 0.0)
        w.flush()
        print("ack", i, int(rows[0]), flush=True)
        i += 1
""")


def _start_writer(tmp_path: Path, log_dir: Path, base: int, mode: str) -> subprocess.Popen:
    script = tmp_path / "writer.py"
    script.write_text(WRITER_SCRIPT.format(repo=str(REPO), tests=str(REPO / "tests")))
    proc = subprocess.Popen([sys.executable, str(script), str(log_dir), str(base), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().split()[0] == "ready"
    return proc


def test_kill9_writer_loses_no_flushed_row_and_next_writer_continues(tmp_path):
    log_dir = tmp_path / "run" / "rollouts"
    bases = [0, 10_000, 20_000]
    acked = []
    for base in bases:  # three writer lives, each killed mid-stream
        proc = _start_writer(tmp_path, log_dir, base, "stream")
        try:
            for _ in range(15):
                line = proc.stdout.readline().split()
                assert line[0] == "ack"
            acked.append(int(line[1]) + 1)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    # the fourth start opens the next segment after everything the killed ones had flushed
    with RolloutLogWriter(log_dir, SCHEMA, "killme", {}) as w:
        assert w.path.name == segment_name(3) and not w.problems
        prior_rows = w.first_row
        extra = make_batch(SCHEMA, 99, 3, first_group=90_000)
        np.testing.assert_array_equal(w.append_samples(extra), prior_rows + np.arange(3))
    with RolloutLog.open(log_dir) as log:
        assert log.num_samples == prior_rows + 3 == log.num_readable
        start = 0
        for seg, base, n_acked in zip(log.segments, bases, acked):
            assert seg.first_row == start
            n_batches, rem = divmod(seg.num_rows, 8)
            assert rem == 0 and n_batches >= n_acked  # whole flushes only, every acked one
            got = log.read(np.arange(start, start + seg.num_rows))
            want = SampleBatch.concat([make_batch(SCHEMA, base + i, 8, first_group=base + 2 * i)
                                       for i in range(n_batches)])
            assert_batches_equal(got, want)  # each flushed row exactly once, in order
            start += seg.num_rows
        assert_batches_equal(log.read(prior_rows + np.arange(3)), extra)
        state = log.resume_state()
        assert state.duplicate_groups == 0
        assert len(state.stored["group_id"]) == 2 * (prior_rows // 8)
        np.testing.assert_array_equal(np.sort(log.read(state.stored["first_row"]).columns["group_id"]),
                                      np.sort(state.stored["group_id"]))
    killed = (log_dir / segment_name(0)).read_bytes()  # a killed writer's file, then cut short
    (tmp_path / "cut.h5").write_bytes(killed[:len(killed) // 2])
    with pytest.raises(CorruptSegmentError, match="truncated"):
        RolloutLog.open(tmp_path / "cut.h5")


def test_live_reader_sees_each_flush_of_a_running_writer(tmp_path):
    log_dir = tmp_path / "rollouts"
    proc = _start_writer(tmp_path, log_dir, 0, "step")
    try:
        with RolloutLog.open(log_dir) as log:
            assert log.num_samples == 0  # a live segment before its first flush
            for i in range(3):
                proc.stdin.write("go\n")
                proc.stdin.flush()
                assert proc.stdout.readline().split()[:2] == ["ack", str(i)]
                log.refresh()
                assert log.num_samples == 8 * (i + 1)
                assert_batches_equal(log.read(np.arange(8 * i, 8 * i + 8)),
                                     make_batch(SCHEMA, i, 8, first_group=2 * i))
                assert len(log.groups()["group_id"]) == 2 * (i + 1)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_refusals_leave_the_existing_log_untouched(tmp_path):
    log_dir = tmp_path / "rollouts"
    with RolloutLogWriter(log_dir, SCHEMA, "run-a", {}) as w:
        w.append_samples(make_batch(SCHEMA, 1, 5))
    before = _digest(log_dir)
    with pytest.raises(SchemaMismatchError, match="record schema"):
        RolloutLogWriter(log_dir, RecordSchema(), "run-a", {})
    with pytest.raises(SchemaMismatchError, match="run-a"):
        RolloutLogWriter(log_dir, SCHEMA, "run-b", {})
    assert _digest(log_dir) == before
    with RolloutLogWriter(log_dir, SCHEMA, "run-a", {}) as w:
        with pytest.raises(LogLockedError, match="another rollout log writer"):
            RolloutLogWriter(log_dir, SCHEMA, "run-a", {})
        with pytest.raises(SchemaMismatchError):
            w.append_samples(make_batch(RecordSchema(), 2, 3))
        with pytest.raises(LogError, match="outside GroupOutcome"):
            w.append_groups(1, 0, 9, -1, 0, 0, 0.0)
        with pytest.raises(LogError, match="rows must be"):
            w.append_steps(0, [5], 0, 0, 0.0)  # row 5 does not exist (5 rows: 0..4)
    with h5py.File(log_dir / segment_name(1), "r+") as f:  # a future Tokenflow's segment
        f.attrs["tokenflow_schema_version"] = 99
    before = _digest(log_dir)
    with pytest.raises(NewerSchemaError, match="version 99"):
        RolloutLogWriter(log_dir, SCHEMA, "run-a", {})
    assert _digest(log_dir) == before


def test_damaged_last_segment_is_tolerated_and_reported(tmp_path):
    log_dir = tmp_path / "rollouts"
    with RolloutLogWriter(log_dir, SCHEMA, "r", {}) as w:
        w.append_samples(make_batch(SCHEMA, 1, 6))
    with RolloutLogWriter(log_dir, SCHEMA, "r", {}) as w:
        w.append_samples(make_batch(SCHEMA, 2, 7, completion_len=(2000, 3000)))
    seg1 = log_dir / segment_name(1)
    data = seg1.read_bytes()
    seg1.write_bytes(data[:len(data) * 2 // 3])  # cut short, as by a full disk
    with pytest.warns(UserWarning, match="segment-00001.h5"):
        w = RolloutLogWriter(log_dir, SCHEMA, "r", {})
    with w:
        assert w.first_row == 6 and w.path.name == segment_name(2)
        assert len(w.problems) == 1 and "truncated" in w.problems[0]
        w.append_samples(make_batch(SCHEMA, 3, 2))
        assert_batches_equal(w.read_samples([0, 6]), SampleBatch.concat(
            [make_batch(SCHEMA, 1, 6).take([0]), make_batch(SCHEMA, 3, 2).take([0])]))


def test_groups_steps_and_resume_state(tmp_path):
    log_dir = tmp_path / "rollouts"
    with RolloutLogWriter(log_dir, SCHEMA, "r", {}) as w:
        b = make_batch(SCHEMA, 5, 8, first_group=0)
        rows = w.append_samples(b)
        w.append_groups([0, 1, 2, 3], [0, 1, 0, 2],
                        [GroupOutcome.STORED, GroupOutcome.STORED, GroupOutcome.FILTERED,
                         GroupOutcome.DROPPED_STALE], [0, 4, -1, -1], [4, 4, 0, 0], 0, 1.5)
        w.append_steps(0, rows[:4], [0, 0, 1, 1], trainer_version=0, t=2.0)
        w.append_steps(1, rows[4:6], 1, trainer_version=1, t=3.0)
    with RolloutLogWriter(log_dir, SCHEMA, "r", {}) as w:  # a resume re-runs step 1
        w.append_steps(1, [4, 5, 6], [0, 1, 0], trainer_version=1, t=4.0)
        w.append_groups(7, 0, GroupOutcome.DROPPED_INVALID, -1, 0, 0, 5.0)
    with RolloutLog.open(log_dir) as log:
        st = log.resume_state()
        np.testing.assert_array_equal(st.stored["group_id"], [0, 1])
        np.testing.assert_array_equal(st.stored["attempt"], [0, 1])
        np.testing.assert_array_equal(st.stored["first_row"], [0, 4])
        assert st.resolved[GroupOutcome.FILTERED].tolist() == [2]
        assert st.resolved[GroupOutcome.DROPPED_INVALID].tolist() == [7]
        assert st.counts == {"stored": 2, "filtered": 1, "dropped_stale": 1, "dropped_invalid": 1,
                             "evicted_stale": 0, "dropped_rollback": 0}
        assert st.max_group_id == 7 and st.duplicate_groups == 0
        assert {k: v.tolist() for k, v in st.step_rows.items()} == {0: [0, 1, 2, 3], 1: [4, 5, 6]}
        assert st.consumed_rows.tolist() == [0, 1, 2, 3, 4, 5, 6]
        assert st.last_step == 1 and st.last_trainer_version == 1
        meta = log.step_meta()
        assert meta["n_samples"].tolist() == [4, 2, 3]
        lens = b.columns["prompt_len"].astype(int) + b.columns["completion_len"]
        assert meta["n_tokens"].tolist() == [lens[:4].sum(), lens[4:6].sum(), lens[4:7].sum()]
        assert log.steps()["dp_rank"].tolist() == [0, 0, 1, 1, 1, 1, 0, 1, 0]
        got = list(log.iter_batches(batch_size=100, steps=[1]))
        assert_batches_equal(got[0], b.take([4, 5, 6]))


def test_filesystem_detection_and_non_swmr_mode(tmp_path):
    mounts = ("/dev/vda / ext4 rw 0 0\nserver:/export /mnt/shared nfs4 rw 0 0\n"
              "lfs@o2ib:/scratch /lustre/scratch lustre rw 0 0\n")
    assert filesystem_type(Path("/mnt/shared/runs/x/rollouts"), mounts) == "nfs4"
    assert filesystem_type(Path("/lustre/scratch/u/run"), mounts) == "lustre"
    assert filesystem_type(Path("/mnt/sharedother"), mounts) == "ext4"
    assert filesystem_type(tmp_path) not in ("", "unknown")  # the real /proc/mounts
    log_dir = tmp_path / "rollouts"
    with RolloutLogWriter(log_dir, SCHEMA, "r", {}, swmr=False, fsync=True) as w:
        w.append_samples(make_batch(SCHEMA, 4, 5))
        w.flush()
        assert_batches_equal(w.read_samples(np.arange(5)), make_batch(SCHEMA, 4, 5))
    with RolloutLog.open(log_dir) as log:
        assert_batches_equal(log.read(np.arange(5)), make_batch(SCHEMA, 4, 5))
    assert os.stat(log_dir / segment_name(0)).st_size > 0
