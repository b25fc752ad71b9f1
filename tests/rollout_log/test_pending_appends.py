"""Joining a flush's parts (`pipeline/rollout_log/pending.py`): adjacent views of one array become
one view of it, large parts that are not stay where they lie (`wire.Pieces`, runs of adjacent views
merged), small ones are concatenated; either way the same values in order, and a journal entry
written from pieces reads back as the concatenation."""
from __future__ import annotations

import numpy as np

from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.protocol.wire import Pieces
from pipeline.rollout_log.format import dataset_layout
from pipeline.rollout_log.pending import JOIN_VIEWS_MIN_BYTES, PendingAppends, join
from pipeline.rollout_log.reader import RolloutLog
from pipeline.rollout_log.writer import RolloutLogWriter
from support.rollout_data import assert_batches_equal, make_batch

ROWS = JOIN_VIEWS_MIN_BYTES // 4  # int32 rows enough to be worth joining as a view


def _values(joined) -> np.ndarray:
    return np.concatenate(joined.parts) if isinstance(joined, Pieces) else joined


def test_adjacent_views_join_without_a_copy():
    base = np.arange(4 * ROWS, dtype=np.int32)
    parts = [base[0:ROWS], base[ROWS:3 * ROWS], base[3 * ROWS:]]
    joined = join(parts)
    assert isinstance(joined, np.ndarray) and np.shares_memory(joined, base)
    np.testing.assert_array_equal(joined, base)
    routed = np.arange(3 * ROWS * 4, dtype=np.int16).reshape(3 * ROWS, 2, 2).copy()  # trailing dims
    joined = join([routed[ROWS:2 * ROWS], routed[2 * ROWS:]])
    assert np.shares_memory(joined, routed)
    np.testing.assert_array_equal(joined, routed[ROWS:])


def test_large_parts_that_are_not_back_to_back_stay_in_place_as_pieces():
    base = np.arange(4 * ROWS, dtype=np.int32)
    other = np.arange(ROWS, 2 * ROWS, dtype=np.int32)
    cases = {  # parts -> the pieces expected (runs of adjacent views merged)
        "a gap": ([base[0:ROWS], base[ROWS + 1:2 * ROWS]], 2),
        "out of order": ([base[ROWS:2 * ROWS], base[0:ROWS]], 2),
        "another array": ([base[0:ROWS], other], 2),
        "a run, then another array": ([base[0:ROWS], base[ROWS:2 * ROWS], np.zeros(0, np.int32), other], 2),
        "two runs of one array": ([base[0:ROWS], base[ROWS:2 * ROWS], base[3 * ROWS:]], 2),
    }
    for why, (parts, n) in cases.items():
        joined = join(parts)
        assert isinstance(joined, Pieces) and len(joined.parts) == n, why
        assert all(any(np.shares_memory(piece, p) for p in parts) for piece in joined.parts), why
        assert joined.shape == (sum(map(len, parts)),) and joined.dtype == np.int32, why
        np.testing.assert_array_equal(_values(joined), np.concatenate(parts), err_msg=why)
    strided = join([base[0:2 * ROWS:2], base[2 * ROWS:4 * ROWS:2]])  # made contiguous: copies
    np.testing.assert_array_equal(_values(strided), base[::2])


def test_large_parts_of_different_dtypes_are_concatenated_with_numpys_promotion():
    joined = join([np.arange(ROWS, dtype=np.int32), np.arange(ROWS, dtype=np.int64)])
    assert isinstance(joined, np.ndarray) and joined.dtype == np.int64
    np.testing.assert_array_equal(joined, np.concatenate([np.arange(ROWS)] * 2))


def test_small_parts_are_concatenated():
    base = np.arange(64, dtype=np.int32)
    joined = join([base[0:8], base[8:16], base[20:24]])
    assert isinstance(joined, np.ndarray) and not np.shares_memory(joined, base)
    np.testing.assert_array_equal(joined, np.concatenate([base[0:16], base[20:24]]))


def test_a_flush_written_from_pieces_reads_back_from_the_journal_and_the_segment(tmp_path):
    """Two batches' token columns (~128 KB each, not adjacent) go to the journal as pieces; the
    log read from the journal alone (the writer still open), then from its sealed segment, holds
    the batches' rows in order."""
    schema = RecordSchema()
    batches = [make_batch(schema, seed, 8, first_group=2 * seed, completion_len=(4000, 4000))
               for seed in range(2)]
    pending = PendingAppends(dataset_layout(schema))
    pending.push("samples", {"completion_ids": [b.columns["completion_ids"] for b in batches]})
    assert isinstance(pending.joined()["samples/completion_ids"], Pieces)
    expected = SampleBatch.concat(batches)
    with RolloutLogWriter(tmp_path / "rollouts", schema, "r", {}) as w:
        w.append_samples(*batches)
        w.flush()
        with RolloutLog.open(tmp_path) as log:
            assert not log.segments[0].path.suffix == ".h5" and log.num_samples == 16
            assert_batches_equal(log.read(np.arange(16)), expected)
    with RolloutLog.open(tmp_path) as log:
        assert log.segments[0].path.suffix == ".h5"
        assert_batches_equal(log.read(np.arange(16)), expected)
