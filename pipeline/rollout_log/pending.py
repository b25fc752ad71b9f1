"""What the rollout log writer holds between flushes: appended parts per dataset, joined into one
flush entry.

Invariants:
- the parts of a dataset are kept by reference in append order until `PendingAppends.clear`
  (after a flush wrote them); `PendingAppends.joined` returns one array per dataset of the layout
  (empty where nothing was appended);
- joining copies only when it must: a single part is returned as is, and parts that are adjacent
  views of one array (the groups of one checked batch, `SampleBatch.rows`) are returned as one
  view of it; other parts are concatenated.

Worked example: a turn's 25 groups of 8 x 1K tokens, checked as one 200-sample batch and stored
group by group, leave 25 adjacent 8K-token views of that batch's ``completion_ids``: the flush
entry holds one 200K-token view of it, no copy (25 separate messages would be concatenated).
"""
from __future__ import annotations

import numpy as np

from pipeline.rollout_log.format import TABLES

JOIN_VIEWS_MIN_BYTES = 64 << 10
"""Parts smaller than this in all are concatenated without looking for adjacent views."""


class PendingAppends:
    """Parts appended since the last flush, per dataset of the layout, and rows per table."""

    def __init__(self, layout: dict):
        self.layout = layout
        self.parts: dict[str, list[np.ndarray]] = {name: [] for name in layout}
        self.counts = dict.fromkeys(TABLES, 0)

    def push(self, table: str, cols: dict[str, list[np.ndarray]], rows: int | None = None) -> None:
        """Append the parts of each column of ``table`` (``rows`` rows in all; default: the first
        column's parts' length)."""
        for k, v in cols.items():
            self.parts[f"{table}/{k}"] += v
        self.counts[table] += sum(map(len, next(iter(cols.values())))) if rows is None else rows

    def joined(self) -> dict[str, np.ndarray]:
        """One array per dataset of everything pushed (module invariants)."""
        entry = {}
        for name, parts in self.parts.items():
            spec = self.layout[name]
            entry[name] = (np.asarray(join(parts), dtype=spec.dtype) if parts
                           else np.zeros((0, *spec.trail), spec.dtype))
        return entry

    def clear(self) -> None:
        """Forget everything pushed (a flush wrote it)."""
        for parts in self.parts.values():
            parts.clear()
        self.counts = dict.fromkeys(TABLES, 0)


def join(parts: list[np.ndarray]) -> np.ndarray:
    """The parts one after another: the part itself, a view of adjacent views, or a copy."""
    if len(parts) == 1:
        return parts[0]
    view = _adjacent_view(parts)
    return view if view is not None else np.concatenate(parts)


def _adjacent_view(parts: list[np.ndarray]) -> np.ndarray | None:
    """One view spanning ``parts`` if they are C-contiguous, back-to-back slices along the first
    axis of one C-contiguous array; else None."""
    base = parts[0].base
    if (not isinstance(base, np.ndarray) or not base.flags.c_contiguous or base.ndim == 0
            or sum(p.nbytes for p in parts) < JOIN_VIEWS_MIN_BYTES):
        return None
    row = base.strides[0]
    origin = base.ctypes.data
    start = pos = parts[0].ctypes.data - origin
    for p in parts:
        if (p.base is not base or p.dtype != base.dtype or p.shape[1:] != base.shape[1:]
                or not p.flags.c_contiguous or p.ctypes.data - origin != pos):
            return None
        pos += p.nbytes
    if row <= 0 or start % row or pos % row:
        return None
    return base[start // row:pos // row]
