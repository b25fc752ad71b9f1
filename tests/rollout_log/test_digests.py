"""A seal writes and digests each dataset from the flushes' chunks where they lie.

A seal writes each dataset from the flushes' chunks (`write_sealed_segment`: every chunk where it
lies, at the dataset's place in the file, synced every `SEAL_SYNC_BYTES`) and digests them in the same pieces; a
reader digests the stored rows in one piece (`pipeline.rollout_log.digests.verified`). The
references here: zlib's crc32 of each block's bytes, cut from one joined copy by hand, and the
batches the writer was given.
"""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.rollout_log.digests import block_rows, digest
from pipeline.rollout_log.format import SEAL_SYNC_BYTES, dataset_layout
from pipeline.rollout_log.reader import RolloutLog
from pipeline.rollout_log.segment_map import MappedFile, hdf5_damage
from pipeline.rollout_log.writer import RolloutLogWriter
from support.rollout_data import assert_batches_equal, make_batch


def _by_hand(whole: np.ndarray, rows: int) -> list[int]:
    raw = whole.tobytes()
    step = rows * whole[:1].nbytes
    return [zlib.crc32(raw[i:i + step]) for i in range(0, len(raw), step)]


@pytest.mark.parametrize("shape, dtype", [((70_001,), np.int32), ((9_000, 3), np.int16), ((5,), np.float64)])
def test_pieces_digest_as_the_joined_rows(shape, dtype):
    rng = np.random.default_rng(7)
    whole = rng.integers(-1000, 1000, shape).astype(dtype)
    rows = block_rows(whole)
    # cuts inside blocks, on a block boundary, empty pieces, and a piece of one row
    cuts = sorted({0, 1, 2, rows, rows + 1, 3 * rows - 1, len(whole) // 2, len(whole)} & set(range(len(whole) + 1)))
    pieces = [whole[a:b] for a, b in zip(cuts, cuts[1:])] + [whole[:0]]
    expected = _by_hand(whole, rows)
    assert digest(pieces, rows).tolist() == expected
    assert digest([whole], rows).tolist() == expected
    assert len(expected) == -(-len(whole) // rows)


def test_a_flipped_byte_changes_only_its_block():
    whole = np.arange(100_000, dtype=np.int32)
    rows = block_rows(whole)
    flipped = whole.copy()
    flipped[rows + 5] ^= 1
    a, b = digest([whole[:rows + 7], whole[rows + 7:]], rows), digest([flipped], rows)
    assert np.flatnonzero(a != b).tolist() == [1]


def test_a_seal_of_large_and_small_flushes_reads_back_whole_and_verified(tmp_path):
    """Flushes whose token chunks are past `SEAL_SYNC_BYTES` between small ones (synced across the
    4 MiB mark); every row read back from the sealed segment,
    each block checked against its digest, equals what was appended; the segment map agrees with
    HDF5's own metadata."""
    schema = RecordSchema(token_rewards=True)
    big = SEAL_SYNC_BYTES // 4 // 8 + 1000  # int32 tokens a sample: 8 samples pass 4 MiB a column
    sizes = [(5, (1, 3000))] * 3 + [(8, (big, big))] + [(6, (1, 9000))] * 30 + [(8, (big, big))] + [(3, (1, 5))]
    batches = []
    with RolloutLogWriter(tmp_path / "rollouts", schema, "seal-runs", {}, seal_interval_s=3600) as w:
        for k, (n, lens) in enumerate(sizes):
            batches.append(make_batch(schema, k, n, first_group=1000 * k, completion_len=lens))
            w.append_samples(batches[-1])
            w.flush()
        w.seal()
        total = w.num_rows
    with RolloutLog.open(tmp_path / "rollouts") as log:
        assert not log.problems and log.num_samples == total == sum(n for n, _ in sizes)
        assert_batches_equal(log.read(np.arange(total)), SampleBatch.concat(batches))
    # the map the seal built as it wrote is the one HDF5 reads: every dataset's place, dtype, shape
    (segment,) = (tmp_path / "rollouts").glob("*.h5")
    mapped = MappedFile(segment)
    assert len(mapped.entries) == 2 * (len(dataset_layout(schema)) + 1) and not hdf5_damage(segment, mapped)


def test_a_seal_writes_on_after_short_writes(tmp_path, monkeypatch):
    """`os.pwritev` may write less than asked (a signal, a full pipe on some filesystems): the
    seal writes the rest, from inside a buffer or from a buffer's boundary, and the segment reads
    back whole."""
    import pipeline.rollout_log.format as fmt
    real, calls = os.pwritev, []

    def short(fd, bufs, offset):  # every other call: at most 1000 bytes, or exactly the first buffer
        kind = "whole" if len(calls) % 2 == 0 else "first" if len(calls) % 4 == 3 and len(bufs) > 1 else "1000"
        calls.append(kind)
        if kind == "first":
            return real(fd, bufs[:1], offset)
        return real(fd, bufs if kind == "whole" else [memoryview(bufs[0])[:1000]], offset)
    monkeypatch.setattr(fmt.os, "pwritev", short)
    schema = RecordSchema()
    batches = [make_batch(schema, k, 6, first_group=10 * k, completion_len=(300, 3000)) for k in range(5)]
    with RolloutLogWriter(tmp_path / "rollouts", schema, "short", {}, seal_interval_s=3600) as w:
        for b in batches:
            w.append_samples(b)
            w.flush()
    assert {"first", "1000"} <= set(calls)
    monkeypatch.undo()
    with RolloutLog.open(tmp_path / "rollouts") as log:
        assert not log.problems
        assert_batches_equal(log.read(np.arange(30)), SampleBatch.concat(batches))
