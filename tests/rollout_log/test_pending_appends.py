"""Joining a flush's parts (`pipeline/rollout_log/pending.py`): adjacent views of one array become
one view of it (no copy), anything else a concatenated copy; either way the same values in order."""
from __future__ import annotations

import numpy as np

from pipeline.rollout_log.pending import JOIN_VIEWS_MIN_BYTES, join

ROWS = JOIN_VIEWS_MIN_BYTES // 4  # int32 rows enough to be worth joining as a view


def _check(parts: list[np.ndarray], expect_view_of: np.ndarray | None) -> None:
    joined = join(parts)
    np.testing.assert_array_equal(joined, np.concatenate(parts))
    assert np.shares_memory(joined, expect_view_of) if expect_view_of is not None else all(
        not np.shares_memory(joined, p) for p in parts)


def test_adjacent_views_join_without_a_copy():
    base = np.arange(4 * ROWS, dtype=np.int32)
    _check([base[0:ROWS], base[ROWS:3 * ROWS], base[3 * ROWS:]], base)
    routed = np.arange(3 * ROWS * 4, dtype=np.int16).reshape(3 * ROWS, 2, 2).copy()  # trailing dims
    _check([routed[ROWS:2 * ROWS], routed[2 * ROWS:]], routed)


def test_parts_that_are_not_back_to_back_views_are_copied():
    base = np.arange(4 * ROWS, dtype=np.int32)
    _check([base[0:ROWS], base[ROWS + 1:2 * ROWS]], None)  # a gap
    _check([base[ROWS:2 * ROWS], base[0:ROWS]], None)  # out of order
    _check([base[0:ROWS], np.arange(ROWS, 2 * ROWS, dtype=np.int32)], None)  # another array
    _check([base[0:2 * ROWS:2], base[2 * ROWS:4 * ROWS:2]], None)  # strided views
    _check([base[0:8], base[8:16]], None)  # small: concatenated without looking
