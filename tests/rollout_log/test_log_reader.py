"""The rollout log reader: path forms, filters, errors naming the problem, damage tolerance."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from pipeline.rollout_log.format import (
    CorruptSegmentError, ForeignFileError, LogDamageWarning, LogError, LogNotFoundError,
    NewerSchemaError, NotHDF5Error, list_segments)
from pipeline.rollout_log.reader import RolloutLog
from pipeline.protocol.record import RecordSchema, SampleBatch
from pipeline.rollout_log.writer import RolloutLogWriter
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
    with pytest.raises(NewerSchemaError, match="version 7"):
        RolloutLog.open(tmp_path / "run")
    with pytest.raises(NewerSchemaError):
        RolloutLog.open(seg1)
    with h5py.File(seg1, "r+") as f:
        f.attrs["tokenflow_schema_version"] = 1
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
        assert len(log.problems) == 1 and seg1.name in log.problems[0]
        assert log.num_samples == 48 and log.num_readable == 8
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


@pytest.mark.parametrize("damage", ["cut", "flipped_byte", "garbage_appended"])
def test_journal_is_read_up_to_its_first_bad_entry(tmp_path, damage):
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
    elif damage == "flipped_byte":  # the second entry damaged on disk: the third is cut too
        data[ends[0] + (ends[1] - ends[0]) * 3 // 4] ^= 0x40
    else:
        data += np.random.default_rng(0).bytes(1000)
    journal.write_bytes(bytes(data))
    good = {"cut": 2, "flipped_byte": 1, "garbage_appended": 3}[damage]
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
        assert log.scan.header["predecessor"]["valid_end"] == ends[good - 1]
        assert_batches_equal(log.read(np.arange(4 * good)), SampleBatch.concat(batches[:good]))
