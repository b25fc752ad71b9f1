"""The rollout log reader: path forms, filters, errors naming the problem, damage tolerance."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from pipeline.rollout_log.format import (
    CorruptSegmentError, ForeignFileError, LogDamageWarning, LogError, LogNotFoundError,
    SCHEMA_VERSION, NewerSchemaError, NotHDF5Error)
from pipeline.rollout_log.reader import RolloutLog
from pipeline.rollout_log.scan import recorded_damage
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.rollout_log.writer import RolloutLogWriter
from support.log_places import list_segments, readable_rows
from support.rollout_data import assert_batches_equal, make_batch

SCHEMA = RecordSchema(routed_experts=(2, 2))


def _segment(log_dir, i):
    """The i-th sealed segment file of a log (names carry generations, not positions)."""
    return list_segments(log_dir)[i][1]


def _write_segments(log_dir, sizes, run_id="r"):
    """One writer start per size; returns the batches written, in row order."""
    batches = []
    for i, n in enumerate(sizes):
        with RolloutLogWriter(log_dir, SCHEMA, run_id, {"start": i}) as w:
            b = make_batch(SCHEMA, i, n, first_group=100 * i, version=i)
            w.append_samples(b)
            batches.append(b)
    return batches


def test_path_forms_run_dir_log_dir_segment_file(tmp_path):
    batches = _write_segments(tmp_path / "rollouts", [5, 3])
    want = SampleBatch.concat(batches)
    for path in (tmp_path, tmp_path / "rollouts", _segment(tmp_path / "rollouts", 1)):
        with RolloutLog.open(path) as log:
            assert log.num_samples == 8 and log.meta == {"start": 1} and log.run_id == "r"
            assert_batches_equal(log.read(np.arange(8)), want)
            assert (log.note is None) == (path.suffix != ".h5")
    with RolloutLog.open(_segment(tmp_path / "rollouts", 0)) as log:
        assert "reading the whole log" in log.note and len(log.segments) == 2


def test_read_any_order_with_repeats_and_column_access(tmp_path):
    batches = _write_segments(tmp_path / "rollouts", [6, 4])
    want = SampleBatch.concat(batches)
    rows = [9, 0, 5, 5, 6, 2]
    with RolloutLog.open(tmp_path) as log:
        assert_batches_equal(log.read(rows), want.take(rows))
        np.testing.assert_array_equal(log.column("samples/reward"), want.columns["reward"])
        np.testing.assert_array_equal(log.min_versions(), want.min_versions())
        np.testing.assert_array_equal(log.rows(), np.arange(10))
        with pytest.raises(LogError, match="not in the readable log"):
            log.read([3, 10])


def test_iter_batches_filters_by_version_and_step(tmp_path):
    log_dir = tmp_path / "rollouts"
    with RolloutLogWriter(log_dir, SCHEMA, "r", {}) as w:
        bs = [make_batch(SCHEMA, v, 5, first_group=10 * v, version=v) for v in range(3)]
        for b in bs:
            w.append_samples(b)
        w.append_steps(0, [7, 1], 0, 1, 0.0)
        w.append_steps(1, [12, 3, 4], [0, 1, 1], 2, 0.0)
    allrows = SampleBatch.concat(bs)
    with RolloutLog.open(log_dir) as log:
        got = SampleBatch.concat(list(log.iter_batches(batch_size=4, min_version=1, max_version=1)))
        assert_batches_equal(got, bs[1])
        got = SampleBatch.concat(list(log.iter_batches(batch_size=2, min_version=2)))
        assert_batches_equal(got, bs[2])
        got = SampleBatch.concat(list(log.iter_batches(batch_size=2, steps=[1, 0])))
        assert_batches_equal(got, allrows.take([7, 1, 12, 3, 4]))  # step order, then record order
        got = SampleBatch.concat(list(log.iter_batches(steps=[1], max_version=0)))
        assert_batches_equal(got, allrows.take([3, 4]))
        assert list(log.iter_batches(steps=[5])) == []


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(LogNotFoundError, match="no such file"):
        RolloutLog.open(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LogNotFoundError, match="no rollout log here"):
        RolloutLog.open(tmp_path / "empty")
    junk = tmp_path / "junk.h5"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(NotHDF5Error, match="junk.h5: not an HDF5 file"):
        RolloutLog.open(junk)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(ForeignFileError, match="not a Tokenflow rollout log"):
        RolloutLog.open(foreign)
    batches = _write_segments(tmp_path / "run" / "rollouts", [4, 4])
    seg1 = _segment(tmp_path / "run" / "rollouts", 1)
    with h5py.File(seg1, "r+") as f:
        f.attrs["tokenflow_schema_version"] = 7
    with RolloutLog.open(tmp_path / "run") as log:  # the header lists its layout: a damaged attribute
        assert_batches_equal(log.read(np.arange(8)), SampleBatch.concat(batches))
    for journal in (tmp_path / "run" / "rollouts").glob("*.tfj"):  # segments only: they decide
        journal.unlink()
    with pytest.raises(NewerSchemaError, match="version 7"):
        RolloutLog.open(tmp_path / "run")
    with pytest.raises(NewerSchemaError):
        RolloutLog.open(seg1)
    with h5py.File(seg1, "r+") as f:
        f.attrs["tokenflow_schema_version"] = SCHEMA_VERSION
    with RolloutLog.open(tmp_path / "run") as log:  # the same log, version restored: readable
        assert_batches_equal(log.read(np.arange(8)), SampleBatch.concat(batches))


@pytest.mark.parametrize("damage", ["truncated", "random_bytes", "empty_file"])
def test_damaged_segment_is_skipped_and_the_rest_stays_readable(tmp_path, damage):
    log_dir = tmp_path / "rollouts"
    batches = _write_segments(log_dir, [5, 40, 3])
    seg1 = _segment(log_dir, 1)
    data = seg1.read_bytes()
    seg1.write_bytes({"truncated": data[:len(data) // 2],
                      "random_bytes": np.random.default_rng(1).bytes(len(data)),
                      "empty_file": b""}[damage])
    with pytest.warns(LogDamageWarning, match=seg1.name):
        log = RolloutLog.open(log_dir)
    with log:
        assert len(log.problems) == 2 and seg1.name in log.problems[0]
        assert "1 segment(s): 40 rows" in log.problems[1]  # counted from the journal header
        assert log.num_samples == 48 and readable_rows(log) == 8
        assert_batches_equal(log.read(np.arange(5)), batches[0])
        assert_batches_equal(log.read(np.arange(45, 48)), batches[2])  # rows keep their numbers
        with pytest.raises(LogError, match="not in the readable log"):
            log.read([5])
    with pytest.raises(CorruptSegmentError if damage == "truncated" else LogError,
                       match=seg1.name):
        RolloutLog.open(log_dir, strict=True)
    single = tmp_path / "alone.h5"  # the damaged file on its own: nothing readable -> its error
    single.write_bytes(seg1.read_bytes())
    with pytest.raises(CorruptSegmentError if damage == "truncated" else NotHDF5Error,
                       match="alone.h5"):
        RolloutLog.open(single)


@pytest.mark.parametrize("damage", ["cut", "zeros_appended"])
def test_journal_is_read_up_to_its_torn_tail(tmp_path, damage):
    log_dir = tmp_path / "rollouts"
    w = RolloutLogWriter(log_dir, SCHEMA, "r", {}, seal_interval_s=3600)
    batches = [make_batch(SCHEMA, i, 4, first_group=10 * i) for i in range(3)]
    ends = []
    for b in batches:
        w.append_samples(b)
        w.flush()
        ends.append(w.path.stat().st_size)
    journal = w.path
    data = bytearray(journal.read_bytes())
    if damage == "cut":  # a writer killed while writing its third entry
        data = data[:ends[1] + (ends[2] - ends[1]) // 2]
    else:  # a node crash: the file's size grew, its last blocks were never written
        data += bytes(4096)
    journal.write_bytes(bytes(data))
    good = {"cut": 2, "zeros_appended": 3}[damage]
    with RolloutLog.open(log_dir) as log:
        assert log.num_samples == 4 * good and not log.problems
        assert_batches_equal(log.read(np.arange(4 * good)), SampleBatch.concat(batches[:good]))
        assert f"up to byte {ends[good - 1]}" in log.lag_note()
    w._journal.close()  # the writer is gone (as if killed); the next start cuts at the same byte
    with pytest.warns(LogDamageWarning, match=f"ignored after byte {ends[good - 1]}"):
        w2 = RolloutLogWriter(log_dir, SCHEMA, "r", {})
    with w2:
        assert w2.first_row == 4 * good
    with RolloutLog.open(log_dir) as log:
        assert log.scan.header.predecessor.valid_end == ends[good - 1]
        assert_batches_equal(log.read(np.arange(4 * good)), SampleBatch.concat(batches[:good]))


@pytest.mark.parametrize("where", ["payload", "lengths", "marker", "header", "last_entry"])
def test_damaged_journal_entry_is_reported_the_rest_kept_and_the_file_quarantined(tmp_path, where):
    """A bad entry followed by valid ones is damage, not a torn tail: the entries after it are
    read, the damage is named, and the next writer copies the journal aside (never deleted) and
    carries its intact rows; only the damaged entry's rows are lost."""
    log_dir = tmp_path / "rollouts"
    w = RolloutLogWriter(log_dir, SCHEMA, "r", {}, seal_interval_s=3600)
    batches = [make_batch(SCHEMA, i, 4, first_group=10 * i) for i in range(3)]
    ends = [w.path.stat().st_size]
    for i, b in enumerate(batches):
        w.append_samples(b)
        w.append_steps(i, [4 * i], 0, i, 0.0)
        w.flush()
        ends.append(w.path.stat().st_size)
    journal = w.path
    original = journal.read_bytes()
    data = bytearray(original)
    hit = {"payload": (ends[1] + ends[2]) // 2, "lengths": ends[1] + 9, "marker": ends[1] + 1,
           "header": 40, "last_entry": ends[3] - 100}[where]
    data[hit] ^= 0x08
    journal.write_bytes(bytes(data))
    lost = 0 if where == "header" else 1  # the header is written twice: its copy stands in
    kept = {"header": [0, 1, 2], "last_entry": [0, 1]}.get(where, [0, 2])
    rows = np.concatenate([4 * k + np.arange(4) for k in kept])
    end = 8 if where == "last_entry" else 12  # a lost last entry: its rows' numbers are free
    with RolloutLog.open(log_dir) as log:
        assert any("damaged" in p for p in log.problems)
        assert log.num_samples == end
        assert_batches_equal(log.read(rows), SampleBatch.concat([batches[k] for k in kept]))
        if lost:
            with pytest.raises(LogError, match="not in the readable log"):
                log.read([8 if where == "last_entry" else 4])
        assert log.scan.lost.entries == lost
        if where != "last_entry":  # what a lost last entry held is unknown: every row is withheld
            assert log.scan.lost.rows == 4 * lost and log.scan.lost.step_records == lost
        assert log.scan.lost.withhold_below == (8 if lost else 0)
    w._journal.close()  # the writer is gone (as if killed)
    with pytest.warns(LogDamageWarning, match="damaged"):
        w2 = RolloutLogWriter(log_dir, SCHEMA, "r", {})
    with w2:
        assert w2.first_row == end
        w2.append_samples(make_batch(SCHEMA, 9, 2, first_group=90))
    quarantined = log_dir / (journal.name + ".damaged")
    assert quarantined.read_bytes() == bytes(data)  # the evidence, byte for byte
    rows_lost = {"header": 0, "last_entry": 0}.get(where, 4)  # (a lost last entry's: unknown)
    assert recorded_damage(log_dir) == [  # what `tokenflow status` shows
        f"{quarantined.name} quarantined: {lost} journal entries, {rows_lost} rows, "
        f"{0 if where == 'last_entry' else lost} step records lost"]
    with RolloutLog.open(log_dir) as log:  # after two more generations the rows are still there
        assert log.num_samples == end + 2 and log.scan.lost.entries == lost
        assert_batches_equal(log.read(rows), SampleBatch.concat([batches[k] for k in kept]))
        assert sorted(s for s, _, _ in log.step_records()) == kept


def test_a_log_written_before_entry_checksums_and_renamed_columns_still_reads(tmp_path):
    """tests/support/golden/log_tfj1: written by the previous release (TFJ1 journal entries, step_meta's
    ``trainer_version`` column, now ``trainer_step``); a sealed segment of 12 rows, then a journal of
    12 more. Read, then continued by today's writer, whose records read alongside the old ones."""
    import shutil
    from pathlib import Path
    log_dir = tmp_path / "rollouts"
    shutil.copytree(Path(__file__).parents[1] / "support" / "golden" / "log_tfj1", log_dir)
    want = SampleBatch.concat([make_batch(SCHEMA, 100 + i, 6, first_group=10 * i) for i in range(4)])
    with RolloutLog.open(log_dir) as log:
        assert not log.problems and log.num_samples == 24
        assert_batches_equal(log.read(np.arange(24)), want)
        assert [(s, v, r.tolist()) for s, v, r in log.step_records()] == [
            (0, 1, [0, 1]), (1, 2, [6, 7]), (2, 3, [12]), (3, 4, [18])]
    with RolloutLogWriter(log_dir, SCHEMA, "old-run", {}) as w:
        assert w.first_row == 24
        w.append_samples(make_batch(SCHEMA, 7, 2, first_group=70))
        w.append_steps(4, [24, 25], 0, trainer_step=5, t=9.0)
    with RolloutLog.open(log_dir) as log:
        assert log.num_samples == 26 and not log.problems
        assert_batches_equal(log.read(np.arange(24)), want)
        assert [(s, v) for s, v, _ in log.step_records()] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
        assert log.step_meta()["trainer_step"].tolist() == [1, 2, 3, 4, 5]
        state = log.resume_state()
        assert state.last_step == 4 and state.last_trainer_step == 5
    newest = max(log_dir.glob("segment-*.h5"))  # sealed by today's writer: today's layout and names
    with h5py.File(newest, "r") as f:
        assert f.attrs["tokenflow_schema_version"] == SCHEMA_VERSION and "trainer_step" in f["step_meta"]
