"""Writer of the durable rollout log (layout in `log_format`): one new SWMR segment per start.

Invariants:

- one writer per log at a time (an exclusive ``flock`` on ``LOG_DIR/writer.lock``, released by the
  kernel even on ``kill -9``); each start writes a *new* segment, never reopening an old one;
- a start refuses, modifying nothing existing, when the log holds a foreign file, a newer layout,
  or segments of another run id or record schema; damaged segments (a writer killed while creating
  or flushing, a truncated file) are tolerated: what is readable counts, the rest is in ``problems``;
- the new segment's first global row is where the readable log ends, so rows already handed out
  never change meaning;
- appends are buffered in memory and written at `flush` in one batch per dataset (batched appends
  are ~16x faster than per-sample ones), followed by one commit row: after `flush` returns,
  everything appended so far survives a ``kill -9`` of this process and is visible to SWMR readers;
  a crash before that loses only unflushed appends (acknowledge results only after `flush`).

Filesystems: SWMR needs POSIX write ordering, which NFS, SMB, Lustre, GPFS, BeeGFS, CephFS and
GlusterFS clients do not give; there the writer refuses with `UnsupportedFilesystemError` unless
``swmr=False`` is passed. Without SWMR, live readers cannot open the segment, and a writer killed
with ``kill -9`` leaves its segment unreadable until ``h5clear -s SEGMENT`` is run on it (readers
report the segment as damaged with that hint).

Worked example: a log whose segments 0 and 1 hold 100 and 40 readable rows starts segment 2 at
global row 140; ``append_samples`` of a 3-sample batch returns rows [140, 141, 142].
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline.log_format import (
    GROUP_COLUMNS, STEP_COLUMNS, STEP_META_COLUMNS, SWMR_UNSAFE_FILESYSTEMS,
    TABLES, GroupOutcome, LogError, LogLockedError, SchemaMismatchError, UnsupportedFilesystemError,
    create_segment_file, dataset_layout, filesystem_type, list_segments, segment_attrs, segment_name)
from pipeline.log_reader import RolloutLog, open_segments, warn_damaged
from pipeline.log_segment import Segment
from pipeline.record import PROMPT_COLUMN, SCALAR_COLUMNS, RecordSchema, SampleBatch


ArrayLike = int | float | Sequence | np.ndarray


class RolloutLogWriter:
    """Appends samples, resolved groups and step records to a run's rollout log."""

    def __init__(self, log_dir: Path, schema: RecordSchema, run_id: str, meta: dict | None = None,
                 *, swmr: bool = True, fsync: bool = False):
        """``log_dir`` is ``RUN/rollouts``; ``meta`` (JSON-able) is stored in the new segment;
        ``fsync`` also syncs each flush to the device (survives a node crash, not just kill -9)."""
        self.log_dir, self.schema, self.run_id = Path(log_dir), schema, run_id
        self.swmr, self.fsync = swmr, fsync
        self.log_dir.mkdir(parents=True, exist_ok=True)
        fstype = filesystem_type(self.log_dir)
        if swmr and fstype in SWMR_UNSAFE_FILESYSTEMS:
            raise UnsupportedFilesystemError(
                f"{self.log_dir} is on a {fstype} filesystem, where HDF5 SWMR cannot work (its "
                "clients do not see writes in order); put the run directory on a local disk, or "
                "pass swmr=False (no live readers; a killed writer's segment then needs h5clear -s)")
        self._lock_fd = _take_lock(self.log_dir / "writer.lock")
        prior: list[Segment] = []
        try:
            existing = list_segments(self.log_dir)
            prior, errors = open_segments([p for _, p in existing], strict=False)
            for seg in prior:
                _check_matches(seg, schema, run_id)
            self.problems = [str(e) for e in errors]
            warn_damaged(errors)
            index = existing[-1][0] + 1 if existing else 0
            self.first_row = max((s.first_row + s.num_rows for s in prior), default=0)
            self.path = self.log_dir / segment_name(index)
            create_segment_file(self.path, schema, segment_attrs(schema, run_id, index,
                                                                 self.first_row, meta or {}))
            for stale in self.log_dir.glob("segment-*.h5.tmp"):
                stale.unlink(missing_ok=True)  # left by a writer killed while creating one
            self._file = _open_for_append(self.path, swmr)
        except BaseException:
            for seg in prior:
                seg.close()
            os.close(self._lock_fd)
            raise
        self._layout = dataset_layout(schema)
        self._ds = {name: self._file[name] for name in self._layout}
        self._capacity = dict.fromkeys(self._layout, 0)  # allocated rows (>= written)
        self._commits = self._file["commits"]
        self._n_commits = 0
        self._written = dict.fromkeys(TABLES, 0)  # committed counts, shared with self._live
        self._pending_counts = dict.fromkeys(TABLES, 0)
        self._pending: dict[str, list[np.ndarray]] = {name: [] for name in self._layout}
        self._live = Segment(self._file, self.path, counts=self._written)
        self._log = RolloutLog(prior + [self._live], self.problems)
        self._row_tokens = np.zeros(max(1024, 2 * self.first_row), dtype=np.int64)
        for seg in prior:  # prompt + completion tokens of every row, for step records' n_tokens
            lens = (seg.read_column("samples/prompt_len").astype(np.int64)
                    + seg.read_column("samples/completion_len"))
            self._row_tokens[seg.first_row:seg.first_row + len(lens)] = lens
        self._closed = False

    # -- appends (buffered) -------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Next global row id (counts buffered, not yet flushed samples)."""
        return self.first_row + self._written["samples"] + self._pending_counts["samples"]

    def append_samples(self, batch: SampleBatch) -> np.ndarray:
        """Buffer a batch of samples; returns their global row ids (int64). The batch's arrays
        are kept by reference until `flush`: do not modify them in place before it."""
        self._check_open()
        if batch.schema != self.schema:
            raise SchemaMismatchError(f"batch has record schema {batch.schema}, the log {self.schema}")
        n = len(batch)
        rows = np.arange(self.num_rows, self.num_rows + n, dtype=np.int64)
        if not n:
            return rows
        c = batch.columns
        for table, length, off_name in (("prompt_tokens", "prompt_len", "prompt_offset"),
                                        ("completion_tokens", "completion_len", "completion_offset")):
            start = self._written[table] + self._pending_counts[table]
            lens = c[length].astype(np.int64)
            off = np.empty(n, dtype=np.int64)
            off[0] = start
            np.cumsum(lens[:-1], out=off[1:])
            off[1:] += start
            self._pending[f"samples/{off_name}"].append(off)
            self._pending_counts[table] += int(lens.sum())
        for name in (*SCALAR_COLUMNS, PROMPT_COLUMN[0], *self.schema.token_fields()):
            self._pending[f"samples/{name}"].append(c[name])
        self._pending_counts["samples"] += n
        if rows[-1] >= len(self._row_tokens):
            grown = np.zeros(max(2 * len(self._row_tokens), rows[-1] + 1), dtype=np.int64)
            grown[:len(self._row_tokens)] = self._row_tokens
            self._row_tokens = grown
        self._row_tokens[rows] = c["prompt_len"].astype(np.int64) + c["completion_len"]
        return rows

    def append_groups(self, group_id: ArrayLike, attempt: ArrayLike, outcome: ArrayLike,
                      first_row: ArrayLike, n_samples: ArrayLike, min_version: ArrayLike,
                      t: ArrayLike) -> None:
        """Buffer resolved groups: each argument is a scalar or an array (broadcast together);
        ``outcome`` holds `GroupOutcome` codes, ``first_row`` is -1 for groups not stored."""
        self._check_open()
        values = dict(zip(GROUP_COLUMNS, np.broadcast_arrays(
            *map(np.atleast_1d, (group_id, attempt, outcome, first_row, n_samples, min_version, t)))))
        cols = {k: _cast(f"groups.{k}", values[k], d) for k, d in GROUP_COLUMNS.items()}
        if not np.isin(cols["outcome"], [int(o) for o in GroupOutcome]).all():
            raise LogError(f"groups.outcome holds codes outside GroupOutcome: {values['outcome']}")
        fr = cols["first_row"]
        if ((fr < -1) | (fr >= self.num_rows)).any():
            raise LogError(f"groups.first_row {fr.tolist()} outside -1..{self.num_rows - 1}")
        self._push("groups", cols)

    def append_steps(self, step: int, rows: ArrayLike, dp_ranks: ArrayLike, trainer_version: int,
                     t: float) -> None:
        """Buffer one step record: the global ``rows`` step ``step`` consumed and the data-parallel
        rank each went to (``dp_ranks``: one per row, or a scalar)."""
        self._check_open()
        rows = _cast("steps.row", np.atleast_1d(rows), STEP_COLUMNS["row"])
        if rows.ndim != 1 or (len(rows) and (rows.min() < 0 or rows.max() >= self.num_rows)):
            raise LogError(f"step {step}: rows must be 1-d within 0..{self.num_rows - 1}")
        ranks = _cast("steps.dp_rank", np.broadcast_to(dp_ranks, rows.shape), STEP_COLUMNS["dp_rank"])
        self._push("steps", {"step": np.full(len(rows), step, STEP_COLUMNS["step"]), "row": rows,
                             "dp_rank": ranks})
        self._push("step_meta", {
            "step": np.array([step], STEP_META_COLUMNS["step"]),
            "trainer_version": np.array([trainer_version], STEP_META_COLUMNS["trainer_version"]),
            "n_samples": np.array([len(rows)], STEP_META_COLUMNS["n_samples"]),
            "n_tokens": np.array([self._row_tokens[rows].sum()], STEP_META_COLUMNS["n_tokens"]),
            "t": np.array([t], STEP_META_COLUMNS["t"])})

    def _push(self, table: str, cols: dict[str, np.ndarray]) -> None:
        for k, v in cols.items():
            self._pending[f"{table}/{k}"].append(v)
        self._pending_counts[table] += len(next(iter(cols.values())))

    # -- flush and reads ----------------------------------------------------------------------
    def flush(self) -> None:
        """Write everything appended so far, then commit it (see module invariants)."""
        self._check_open()
        if not any(self._pending_counts.values()):
            return
        for name, parts in self._pending.items():
            if not parts:
                continue
            spec = self._layout[name]
            data = parts[0] if len(parts) == 1 else np.concatenate(parts)
            data = np.ascontiguousarray(data, dtype=spec.dtype)
            n0, dsid = self._written[spec.table], self._ds[name].id
            if self._capacity[name] < n0 + len(data):
                self._capacity[name] = max(n0 + len(data), 2 * self._capacity[name], spec.chunk_rows)
                dsid.set_extent((self._capacity[name], *spec.trail))
            _write_rows(dsid, n0, data)
        self._file.flush()
        counts = {t: self._written[t] + self._pending_counts[t] for t in TABLES}
        seq = self._n_commits + 1
        self._commits.id.set_extent((seq, 1 + len(TABLES)))
        _write_rows(self._commits.id, seq - 1,
                    np.array([[seq, *(counts[t] for t in TABLES)]], dtype=np.int64))
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.id.get_vfd_handle())
        # Only now is the buffer dropped: a flush that raised (e.g. disk full) can be retried.
        self._n_commits = seq
        self._written.update(counts)
        self._pending_counts.update(dict.fromkeys(TABLES, 0))
        for parts in self._pending.values():
            parts.clear()

    def read_samples(self, rows: ArrayLike) -> SampleBatch:
        """Samples at global ``rows`` (any segment, this one included; flushes first if needed)."""
        self._check_open()
        rows = np.atleast_1d(np.asarray(rows, dtype=np.int64))
        if len(rows) and rows.max() >= self.first_row + self._written["samples"]:
            self.flush()
        return self._log.read(rows)

    def close(self) -> None:
        """Flush, trim datasets to their committed lengths, close the file and release the lock."""
        if self._closed:
            return
        try:
            self.flush()
            for name, ds in self._ds.items():
                ds.resize(self._written[self._layout[name].table], axis=0)
            self._file.flush()
        finally:
            self._closed = True
            self._file.close()
            for seg in self._log.segments[:-1]:
                seg.close()
            os.close(self._lock_fd)

    def __enter__(self) -> "RolloutLogWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise LogError(f"the rollout log writer of {self.path} is closed")


def _open_for_append(path: Path, swmr: bool):
    """Open a new segment for writing, directly in SWMR-write mode when ``swmr`` (opening it
    plainly first would leave it unreadable if killed before SWMR starts)."""
    import h5py
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    flags = h5py.h5f.ACC_RDWR | (h5py.h5f.ACC_SWMR_WRITE if swmr else 0)
    return h5py.File(h5py.h5f.open(os.fsencode(path), flags, fapl=fapl))


def _write_rows(dsid, n0: int, data: np.ndarray) -> None:
    """``ds[n0:n0 + len(data)] = data`` through the low-level API (a tenth of the overhead of
    h5py's slicing, which dominated small flushes)."""
    import h5py
    fspace = dsid.get_space()
    fspace.select_hyperslab((n0,) + (0,) * (data.ndim - 1), data.shape)
    dsid.write(h5py.h5s.create_simple(data.shape), fspace, data)


def _cast(name: str, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype != dtype and arr.size:
        if arr.dtype.kind in "iub" and dtype.kind in "iu":
            info = np.iinfo(dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise LogError(f"{name}: values outside the range of {dtype}")
        elif not np.can_cast(arr.dtype, dtype, casting="same_kind"):
            raise LogError(f"{name}: dtype {arr.dtype} cannot be stored as {dtype}")
    if arr.dtype != dtype:
        arr = arr.astype(dtype)
    return np.ascontiguousarray(arr)


def _check_matches(seg: Segment, schema: RecordSchema, run_id: str) -> None:
    if seg.run_id != run_id:
        raise SchemaMismatchError(f"refusing to write: {seg.path} belongs to run {seg.run_id!r}, "
                                  f"not {run_id!r}")
    if seg.schema != schema:
        raise SchemaMismatchError(
            f"refusing to write: {seg.path} has record schema {seg.schema}, this run's config "
            f"gives {schema}; a config change that changes the file schema needs a new run")


def _take_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise LogLockedError(f"{path}: another rollout log writer holds this log (pid {holder})")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
