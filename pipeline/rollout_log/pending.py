"""What the rollout log writer holds between flushes: appended parts per dataset, joined into one
flush entry.

Invariants:
- the parts of a dataset are kept by reference in append order until `PendingAppends.clear`
  (after a flush wrote them); `PendingAppends.joined` returns one array, or one `wire.Pieces`,
  per dataset of the layout (empty where nothing was appended), its rows the parts' in order;
- joining copies only what is small: parts that are adjacent views of one array (the groups of
  one checked batch, `SampleBatch.rows`) become one view of it; a dataset whose parts are then
  one array is that array; one of `JOIN_VIEWS_MIN_BYTES` or more in several arrays of one dtype
  stays in them (`wire.Pieces`: the journal writes them where they lie, the seal too); smaller
  ones (and parts of mixed dtypes) are concatenated.

Worked example: a turn's 40 groups of 8 x 1K tokens from 5 messages of 8 groups each, checked as 5
64-sample batches and stored group by group, leave 40 8K-token views of those batches'
``completion_ids``: the flush entry holds them as 5 pieces (each a 64K-token view of one message's
frame), no copy; their 40 x 8 ``reward`` values (1.3 KB) are concatenated.
"""
from __future__ import annotations

import numpy as np

from pipeline.protocol.wire import Pieces
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

    def joined(self) -> dict[str, np.ndarray | Pieces]:
        """One array or `Pieces` per dataset of everything pushed (module invariants)."""
        entry = {}
        for name, parts in self.parts.items():
            spec = self.layout[name]
            if not parts:
                entry[name] = np.zeros((0, *spec.trail), spec.dtype)
                continue
            joined = join(parts)
            if not isinstance(joined, Pieces):
                entry[name] = np.asarray(joined, dtype=spec.dtype)
            elif joined.dtype != spec.dtype:
                entry[name] = Pieces([p.astype(spec.dtype) for p in joined.parts])
            else:
                entry[name] = joined
        return entry

    def clear(self) -> None:
        """Forget everything pushed (a flush wrote it)."""
        for parts in self.parts.values():
            parts.clear()
        self.counts = dict.fromkeys(TABLES, 0)


def join(parts: list[np.ndarray]) -> np.ndarray | Pieces:
    """The parts one after another: the part itself, a view of adjacent views, the runs of
    adjacent views as `Pieces`, or (when small) a copy."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if (sum([p.nbytes for p in parts]) < JOIN_VIEWS_MIN_BYTES
            or any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in parts)):
        return np.concatenate(parts)  # (parts of other dtypes: numpy's promotion, as one array)
    runs = adjacent_runs(parts)
    return runs[0] if len(runs) == 1 else Pieces(runs)


def adjacent_runs(parts: list[np.ndarray]) -> list[np.ndarray]:
    """``parts`` (the empty ones left out) with every run of C-contiguous, back-to-back slices
    along the first axis of one C-contiguous array replaced by one view of it."""
    runs: list[np.ndarray] = []
    base = None  # the array the current run is a view of
    for p in parts:
        if not p.size:
            continue
        b = p.base
        if isinstance(b, np.ndarray) and p.flags.c_contiguous and b.flags.c_contiguous and b.ndim and (
                p.dtype == b.dtype and p.shape[1:] == b.shape[1:] and b.strides[0] > 0):
            at = p.__array_interface__["data"][0] - b.__array_interface__["data"][0]
            if b is base and at == end:
                end += p.nbytes
                runs[-1] = b[start // row:end // row]
                continue
            row = b.strides[0]
            if not at % row:
                base, start, end = b, at, at + p.nbytes
                runs.append(p)
                continue
        base = None
        runs.append(p)
    return runs
