"""The rollout log writer: round trip, kill -9 at every point, live readers on another mount, a stale
writer fenced, refusals, tolerance; on a local disk and on the loopback network filesystem."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from support.log_places import list_segments, place, readable_rows  # noqa: F401  (place: a fixture)
from pipeline.rollout_log.format import (
    GroupOutcome, LogError, NewerSchemaError, SchemaMismatchError, UnsupportedFilesystemError,
    check_log_filesystem, filesystem_type)
from pipeline.rollout_log.reader import RolloutLog
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.rollout_log.writer import RolloutLogWriter
from support.rollout_data import assert_batches_equal, make_batch

REPO = Path(__file__).resolve().parents[2]
SCHEMA = RecordSchema(token_rewards=True)

schemas = st.builds(
    RecordSchema, token_rewards=st.booleans(), teacher_logprobs=st.booleans(),
    routed_experts=st.none() | st.tuples(st.integers(1, 3), st.integers(1, 3)),
    sampling_mask_k=st.none() | st.integers(1, 4), model_mask=st.booleans())


@given(schema=schemas, sizes=st.lists(st.integers(0, 12), min_size=1, max_size=6),
       flushes=st.lists(st.sampled_from(["", "flush", "seal"]), min_size=6, max_size=6),
       seed=st.integers(0, 2**31),
       long=st.booleans(), joined=st.booleans())
@settings(max_examples=25, deadline=None)
def test_round_trip_sample_batches_through_the_log(schema, sizes, flushes, seed, long, joined):
    """``joined``: the batches between two flushes are appended in one `append_samples` call."""
    clen = (1, 15_000) if long else (1, 40)  # long: crosses 64k-token chunks and regrowths
    batches = [make_batch(schema, seed + i, n, first_group=100 * i, completion_len=clen)
               for i, n in enumerate(sizes)]
    expected = SampleBatch.concat(batches)
    perm = np.random.default_rng(seed).permutation(len(expected))
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp) / "rollouts"
        with RolloutLogWriter(log_dir, schema, "prop", {"k": 1}) as w:
            start, run = 0, []
            for i, (b, flush) in enumerate(zip(batches, flushes)):
                run.append(b)
                if joined and not flush and i < len(batches) - 1:
                    continue
                rows = w.append_samples(*run)
                n = sum(map(len, run))
                np.testing.assert_array_equal(rows, np.arange(start, start + n))
                start, run = start + n, []
                if flush:  # a seal with rows still buffered flushes them first
                    getattr(w, flush)()
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
    import os, signal, sys
    sys.path[:0] = [{repo!r}, {tests!r}]
    import numpy as np
    import pipeline.rollout_log.writer as rl
    from pipeline.rollout_log.format import LogFencedError
    from pipeline.protocol.record import RecordSchema
    from support.rollout_data import make_batch
    log_dir, base, mode, crash = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    schema = RecordSchema(token_rewards=True)
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    state = {{"flushes": 0, "seals": 0}}
    real_append, real_seal = rl.JournalFile.append, rl.write_sealed_segment

    def append(self, parts):  # crash=flush: killed half-way through writing the 6th flush entry
        if crash == "flush" and bytes(parts[2][:1]) and state["flushes"] == 5:
            data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
            os.write(self.fd, data[:len(data) // 2])
            die()
        real_append(self, parts)

    def seal(path, *args):  # crash=seal-*: killed during / after writing the 2nd sealed segment
        state["seals"] += 1
        if state["seals"] == 2 and crash == "seal-writing":
            real_seal(path.with_name("scratch.h5"), *args)
            data = path.with_name("scratch.h5").read_bytes()
            path.with_name("scratch.h5").unlink()
            path.with_name("." + path.name + ".tmp").write_bytes(data[:len(data) // 2])
            die()
        real_seal(path, *args)
        if state["seals"] == 2 and crash == "seal-renamed":
            die()  # the segment is in place, its journal header is not written

    def listed(log_dir):
        if state["seals"] == 2 and crash == "seal-headed":
            die()  # the new generation's header is durable; older journals not removed yet
        return real_list(log_dir)

    real_list = rl.list_journals
    rl.JournalFile.append, rl.write_sealed_segment, rl.list_journals = append, seal, listed
    w = rl.RolloutLogWriter(log_dir, schema, "killme", {{"base": base}}, seal_interval_s=3600)
    print("ready", w.first_row, flush=True)
    i = 0
    rl.FENCE_CHECK_S = 0.0 if mode == "step" else 3600.0  # check at every flush / never
    while True:
        cmd = sys.stdin.readline().strip() if mode == "step" else "flush"
        if cmd == "seal":
            try:
                w.seal()
                print("sealed", flush=True)
            except LogFencedError as e:
                print("fenced", e, flush=True)
            continue
        b = make_batch(schema, base + i, 8, first_group=base + 2 * i)
        rows = w.append_samples(b)
        w.append_groups(np.array([base + 2 * i, base + 2 * i + 1]), 0, 0, rows[[0, 4]], 4, 0, 0.0)
        try:
            w.flush()
        except LogFencedError as e:
            print("fenced", e, flush=True)
            continue
        state["flushes"] += 1
        print("ack", i, int(rows[0]), flush=True)
        i += 1
        if mode == "stream" and i % 4 == 0:
            w.seal()
""")


def _start_writer(tmp_path: Path, log_dir: Path, base: int, mode: str,
                  crash: str = "none") -> subprocess.Popen:
    script = tmp_path / "writer.py"
    script.write_text(WRITER_SCRIPT.format(repo=str(REPO), tests=str(REPO / "tests")))
    proc = subprocess.Popen([sys.executable, str(script), str(log_dir), str(base), mode, crash],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().split()[0] == "ready"
    return proc


def _batch(base: int, i: int) -> SampleBatch:
    return make_batch(SCHEMA, base + i, 8, first_group=base + 2 * i)


CRASHES = ["between", "flush", "seal-writing", "seal-renamed", "seal-headed"]


@pytest.mark.parametrize("crash", CRASHES)
def test_kill9_at_any_point_loses_nothing_acknowledged(tmp_path, place, crash):
    """A writer killed (SIGKILL) between flushes, mid-flush (torn journal tail), mid-seal (segment
    half-written / renamed but unpublished / published but old journals not removed): the next
    start and a reader on another mount see every acknowledged flush exactly once, in order."""
    wdir, rdir = place
    log_dir = wdir / "run" / "rollouts"
    bases, acked = [0, 10_000], []
    for life, base in enumerate(bases):
        proc = _start_writer(tmp_path, log_dir, base, "stream", crash if life == 0 else "none")
        n = 0
        try:
            for line in proc.stdout:
                assert line.split()[:2] == ["ack", str(n)]
                n += 1
                if n == 10 and (crash == "between" or life > 0):
                    break  # killed from outside between two flushes
        finally:
            proc.kill()
            proc.wait(timeout=30)
        assert n == (5 if crash == "flush" and life == 0 else
                     8 if crash.startswith("seal") and life == 0 else 10)
        acked.append(n)
    with RolloutLog.open(rdir / "run") as log:  # another node's view of the live-then-killed log
        assert log.num_samples == readable_rows(log)
        got = log.read(np.arange(log.num_samples))
        life0 = int((got.columns["group_id"] < bases[1]).sum()) // 8
        present = [life0, log.num_samples // 8 - life0]  # flushes of each life in the log
        # every acknowledged flush (the writer may have flushed one more before the kill landed)
        assert all(a <= p <= a + 1 for a, p in zip(acked, present)) and log.num_samples % 8 == 0
        want = SampleBatch.concat([_batch(b, i) for b, n in zip(bases, present) for i in range(n)])
        assert_batches_equal(got, want)  # each exactly once, in order
        state = log.resume_state()
        assert state.duplicate_groups == 0 and len(state.stored["group_id"]) == 2 * sum(present)
        if crash in ("seal-writing", "seal-renamed"):  # what the killed seal left is ignored
            assert any("not listed" in p for p in log.problems) == (crash == "seal-renamed")
    total = 8 * sum(present)
    with RolloutLogWriter(log_dir, SCHEMA, "killme", {}) as w:  # and a third start continues
        assert w.first_row == total
        extra = make_batch(SCHEMA, 99, 3, first_group=90_000)
        np.testing.assert_array_equal(w.append_samples(extra), w.first_row + np.arange(3))
    with RolloutLog.open(rdir / "run") as log:
        assert_batches_equal(log.read(total + np.arange(3)), extra)
    assert not list(log_dir.glob(".*.tmp"))  # a killed seal's leftover is removed


def test_reader_on_another_mount_sees_each_flush_and_seal(tmp_path, place):
    wdir, rdir = place
    proc = _start_writer(tmp_path, wdir / "rollouts", 0, "step")
    try:
        with RolloutLog.open(rdir / "rollouts") as log:
            assert log.num_samples == 0  # a header, nothing flushed yet
            for i, cmd in enumerate(["flush", "flush", "seal", "flush"]):
                proc.stdin.write(cmd + "\n")
                proc.stdin.flush()
                assert proc.stdout.readline().split()[0] == ("sealed" if cmd == "seal" else "ack")
                log.refresh()
                n = 3 if i == 3 else min(i + 1, 2)
                assert log.num_samples == 8 * n and not log.problems
                assert_batches_equal(log.read(np.arange(8 * n)),
                                     SampleBatch.concat([_batch(0, k) for k in range(n)]))
                assert len(log.groups()["group_id"]) == 2 * n
                assert len(log.segments) == (1 if i < 3 else 2)  # journal rows, segment, both
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_stale_writer_is_fenced_by_the_next_one(tmp_path, place):
    """Writer A stops answering (but keeps running); B starts on the other mount: A's next flush
    and its next seal raise LogFencedError (nothing acknowledged), and what A wrote after B's start
    is ignored by every reader."""
    wdir, rdir = place
    a = _start_writer(tmp_path, wdir / "rollouts", 0, "step")
    try:
        for i in range(3):
            a.stdin.write("flush\n")
            a.stdin.flush()
            assert a.stdout.readline().split()[:2] == ["ack", str(i)]
        a_journal = sorted((wdir / "rollouts").glob("journal-*.tfj"))[-1]
        a_end = a_journal.stat().st_size
        b = RolloutLogWriter(rdir / "rollouts", SCHEMA, "killme", {})
        with b:
            assert b.first_row == 24
            for cmd, how in (("flush", "took over"), ("seal", "claimed journal-")):
                a.stdin.write(cmd + "\n")  # the stale writer tries to go on
                a.stdin.flush()
                line = a.stdout.readline()
                assert line.split()[0] == "fenced" and how in line, line
            mine = make_batch(SCHEMA, 77, 5, first_group=7_000)
            b.append_samples(mine)
            b.flush()
            with RolloutLog.open(wdir / "rollouts") as log:
                assert log.scan.header.predecessor.valid_end == a_end
                assert log.num_samples == 29
                want = SampleBatch.concat([_batch(0, k) for k in range(3)] + [mine])
                assert_batches_equal(log.read(np.arange(29)), want)
    finally:
        a.kill()
        a.wait(timeout=30)
    with RolloutLog.open(rdir / "rollouts") as log:
        assert log.num_samples == 29 and log.resume_state().duplicate_groups == 0


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
        with pytest.raises(SchemaMismatchError):
            w.append_samples(make_batch(RecordSchema(), 2, 3))
        with pytest.raises(LogError, match="outside GroupOutcome"):
            w.append_groups(1, 0, 9, -1, 0, 0, 0.0)
        with pytest.raises(LogError, match="rows must be"):
            w.append_steps(0, [5], 0, 0, 0.0)  # row 5 does not exist (5 rows: 0..4)
    with h5py.File(list_segments(log_dir)[-1][1], "r+") as f:  # a future Tokenflow's segment
        f.attrs["tokenflow_schema_version"] = 99
    for journal in log_dir.glob("*.tfj"):  # segments only: their attributes decide
        journal.unlink()
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
    seg1 = list_segments(log_dir)[1][1]
    data = seg1.read_bytes()
    seg1.write_bytes(data[:len(data) * 2 // 3])  # cut short, as by a full disk
    with pytest.warns(UserWarning, match=seg1.name):
        w = RolloutLogWriter(log_dir, SCHEMA, "r", {})
    with w:
        assert w.first_row == 13  # the header knows the lost rows: later rows keep their numbers
        assert len(w.problems) == 2 and "truncated" in w.problems[0]
        assert "1 segment(s): 7 rows" in w.problems[1]
        w.append_samples(make_batch(SCHEMA, 3, 2))
        assert_batches_equal(w.read_samples([0, 13]), SampleBatch.concat(
            [make_batch(SCHEMA, 1, 6).take([0]), make_batch(SCHEMA, 3, 2).take([0])]))


def test_groups_steps_and_resume_state(tmp_path):
    log_dir = tmp_path / "rollouts"
    with RolloutLogWriter(log_dir, SCHEMA, "r", {}) as w:
        b = make_batch(SCHEMA, 5, 8, first_group=0)
        rows = w.append_samples(b)
        w.append_groups([0, 1, 2, 3], [0, 1, 0, 2],
                        [GroupOutcome.STORED, GroupOutcome.STORED, GroupOutcome.FILTERED,
                         GroupOutcome.DROPPED_STALE], [0, 4, -1, -1], [4, 4, 0, 0], 0, 1.5)
        w.append_steps(0, rows[:4], [0, 0, 1, 1], trainer_step=0, t=2.0)
        w.append_steps(1, rows[4:6], 1, trainer_step=1, t=3.0)
    with RolloutLogWriter(log_dir, SCHEMA, "r", {}) as w:  # a resume re-runs step 1
        w.append_steps(1, [4, 5, 6], [0, 1, 0], trainer_step=1, t=4.0)
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
        assert st.last_step == 1 and st.last_trainer_step == 1
        meta = log.step_meta()
        assert meta["n_samples"].tolist() == [4, 2, 3]
        lens = b.columns["prompt_len"].astype(int) + b.columns["completion_len"]
        assert meta["n_tokens"].tolist() == [lens[:4].sum(), lens[4:6].sum(), lens[4:7].sum()]
        assert log.steps()["dp_rank"].tolist() == [0, 0, 1, 1, 1, 1, 0, 1, 0]
        got = list(log.iter_batches(batch_size=100, steps=[1]))
        assert_batches_equal(got[0], b.take([4, 5, 6]))


def test_filesystem_detection_and_durability_probe(tmp_path, place):
    mounts = ("/dev/vda / ext4 rw 0 0\nserver:/export /mnt/shared nfs4 rw 0 0\n"
              "lfs@o2ib:/scratch /lustre/scratch lustre rw 0 0\n"
              "bucket /mnt/s3 fuse.s3fs rw 0 0\n")
    assert filesystem_type(Path("/mnt/shared/runs/x/rollouts"), mounts) == "nfs4"
    assert filesystem_type(Path("/lustre/scratch/u/run"), mounts) == "lustre"
    assert filesystem_type(Path("/mnt/sharedother"), mounts) == "ext4"
    assert filesystem_type(tmp_path) not in ("", "unknown")  # the real /proc/mounts
    with pytest.raises(UnsupportedFilesystemError, match="S3 object-store mount"):
        check_log_filesystem(Path("/mnt/s3/run/rollouts"), mounts)
    wdir, _ = place
    assert check_log_filesystem(wdir / "rollouts") == filesystem_type(wdir)  # probes really run
    assert list((wdir / "rollouts").iterdir()) == []  # and leave nothing behind
    (wdir / "ro").mkdir()
    os.chmod(wdir / "ro", 0o500)
    if os.geteuid() != 0:  # root writes anyway; the probe refuses a directory it cannot write
        with pytest.raises(UnsupportedFilesystemError, match="create a file failed"):
            check_log_filesystem(wdir / "ro")


def test_train_refuses_a_run_dir_that_cannot_hold_the_log_before_any_role_starts(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rollouts").write_text("not a directory")  # the log directory cannot be created
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", "run.name=refused",
                          f"hydra.run.dir={run}", "run.progress=false"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "cannot start the run" in out.stderr and "cannot hold the rollout log" in out.stderr
    assert not (run / "logs").exists() and not (run / "rendezvous").exists()  # nothing started
