"""Block digests of a dataset written in pieces equal those of the dataset read back whole.

A seal writes each dataset from the flushes' chunks where they lie (`write_sealed_segment`), and
digests them in the same pieces; a reader digests the stored rows in one piece
(`pipeline.rollout_log.digests.verified`). The reference here is zlib's crc32 of each block's bytes,
cut from one joined copy by hand.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from pipeline.rollout_log.digests import block_rows, digest


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
