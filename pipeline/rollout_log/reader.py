"""Reader API of the rollout log: the segments of a run, read as one log of global rows.

Invariants:

- global row r of the log is local row ``r - first_row`` of the segment whose range holds it; each
  segment's ``first_row`` attribute was fixed by its writer from what earlier segments held, so a
  skipped (damaged) segment leaves a gap of unreadable rows rather than shifting later rows;
- what is read is the sealed segments plus the journal's valid entries (`scan`): everything a
  writer had acknowledged when the files were read, on any node. A damaged segment (not HDF5,
  truncated, unopenable) is skipped with a `LogDamageWarning` naming it and listed in
  ``problems``; a foreign HDF5 file, a newer layout version, or segments that disagree on run id or
  record schema raise instead (reading on would mislead). ``strict=True`` raises on damage too. If
  nothing is readable, the first error is raised;
- nothing is ever written; ``refresh()`` reads the log again, showing what a live writer
  acknowledged since, and `lag_note` says how far behind the writer the view may be.

Step records: each ``append_steps`` call of the writer is one record (one ``step_meta`` row and
``n_samples`` ``steps`` rows). When a step number is recorded more than once (a resume re-ran it
from a checkpoint), the later record wins in ``resume_state`` and in step filters.
Example: records (step 3: rows [0, 1]), (step 4: rows [2]), after a resume (step 4: rows [2, 5])
-> step_rows = {3: [0, 1], 4: [2, 5]}, consumed_rows = [0, 1, 2, 5], last_step = 4.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from pipeline.rollout_log.format import (
    GROUP_COLUMNS, STEP_COLUMNS, STEP_META_COLUMNS, CorruptSegmentError, GroupOutcome, LogError,
    LogDamageWarning, RELEASE_OUTCOMES, SchemaMismatchError, dataset_layout, resolve_log_path)
from pipeline.rollout_log.scan import LogScan, open_segments, scan_log
from pipeline.rollout_log.segment import Segment
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch

_MERGE_GAP = 64  # rows read as one range when requested rows are at most this far apart


@dataclass
class ResumeState:
    """What an orchestrator needs from the log to restart a run."""
    num_samples: int
    """Next global row id (rows below it exist, except rows lost to damage)."""
    stored: dict[str, np.ndarray]
    """Groups with outcome STORED: group_id, attempt, first_row, n_samples, min_version (by group
    id); those later released from the buffer are also in ``resolved[o]`` for o in `RELEASE_OUTCOMES`."""
    resolved: dict[GroupOutcome, np.ndarray]
    """Group ids of every resolved group, by outcome."""
    counts: dict[str, int]
    """Number of resolved groups by outcome name (lower case)."""
    max_group_id: int
    """Largest group id in the groups table or among stored samples; -1 if none."""
    duplicate_groups: int
    """Resolving group rows (all but `RELEASE_OUTCOMES`, which follow a group's STORED row) whose
    group id was already resolved earlier in the log (0 in a correct run)."""
    step_rows: dict[int, np.ndarray]
    """Step -> global rows it consumed (the latest record of each step)."""
    consumed_rows: np.ndarray
    """Sorted unique rows consumed by the steps of ``step_rows``."""
    last_step: int
    """Largest recorded step; -1 if none."""
    last_trainer_step: int
    """``trainer_step`` of the latest record of ``last_step``; -1 if none."""
    problems: list[str] = field(default_factory=list)
    damaged_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Rows below ``num_samples`` that cannot be read (lost to damage): never buffered."""
    withheld_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Intact rows no intact step record names that a lost step record may have consumed (below
    the damage's ``withhold_below``): never buffered, so no row is trained twice."""
    lost: dict[str, int] = field(default_factory=dict)
    """What damage cost: lost_entries, lost_segments, lost_rows, lost_step_records,
    damaged_blocks, withheld_rows (see `LogLoss`)."""


class RolloutLog:
    """The readable segments of one run's rollout log (see module docstring)."""

    def __init__(self, segments: list[Segment], problems: list[str], note: str | None = None,
                 scan: LogScan | None = None):
        self.segments = segments
        self.problems = problems
        self.note = note
        self.scan = scan
        """What the last read of the files found (journal, valid prefix, newest entry time)."""
        self._verified_damage: list[str] = []
        if segments:
            first = segments[0]
            self.schema: RecordSchema = first.schema
            self.run_id: str = first.run_id
            self._meta = first.meta
        else:  # only a journal header so far
            self.schema = RecordSchema.from_dict(scan.header.record_schema)
            self.run_id, self._meta = scan.header.run_id, scan.header.meta
        for s in segments[1:]:
            _check_same_run(first, s)

    @classmethod
    def open(cls, path, strict: bool = False) -> "RolloutLog":
        """Open the log at a run dir, log dir or segment file (see `resolve_log_path`)."""
        target, note = resolve_log_path(path)
        log = cls._from_scan(cls._scan(target, strict), note)
        log._target, log._strict = target, strict
        return log

    @staticmethod
    def _scan(target: Path, strict: bool) -> LogScan:
        if target.is_dir():
            scan = scan_log(target, strict)
        else:
            segs, errors = open_segments([target], strict)
            scan = LogScan(segs, None, [str(e) for e in errors], errors=errors)
        if not scan.segments and scan.tail is None and scan.errors:
            if len(scan.errors) == 1:
                raise scan.errors[0]
            raise CorruptSegmentError("nothing readable: " + "; ".join(map(str, scan.errors)))
        return scan

    @classmethod
    def _from_scan(cls, scan: LogScan, note: str | None) -> "RolloutLog":
        warn_damaged(scan.problems)
        segments = sorted(scan.segments + scan.carried + ([scan.tail] if scan.tail is not None else []),
                          key=lambda s: s.first_row)
        log = cls(segments, list(scan.problems), note, scan)
        return log

    def __enter__(self) -> "RolloutLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for s in self.segments:
            s.close()

    @property
    def meta(self) -> dict:
        """The ``meta`` given by the latest writer."""
        if self.scan is not None and self.scan.header is not None:
            return self.scan.header.meta
        return self.segments[-1].meta if self.segments else self._meta

    @property
    def num_samples(self) -> int:
        """Next global row id (rows lost to a damaged segment count, but cannot be read)."""
        ends = [s.first_row + s.num_rows for s in self.segments]
        if self.scan is not None:
            ends.append(self.scan.next_row)
        return max(ends, default=0)

    def lag_note(self) -> str | None:
        """How far behind a live writer this view may be (None for a log read from segments only)."""
        scan = self.scan
        if scan is None or scan.journal is None:
            return None
        age = scan.scanned_at - scan.last_entry_t
        note = (f"read {scan.journal.name} up to byte {scan.valid_end} (sequence {scan.next_seq - 1}); "
                f"its newest entry was written {age:.1f} s before this read (writer's clock)")
        if scan.torn:
            note += f"; beyond it: {scan.torn} (a flush in progress, or a torn tail)"
        return note + (". A running writer may have acknowledged more since: up to the time since "
                       "then plus the filesystem's attribute-cache window (NFS actimeo, sshfs "
                       "cache_timeout; 0 on a local disk)")

    @property
    def damage(self) -> list[str]:
        """Damage found so far, one sentence each: when the files were read (journal entries,
        segments lost whole) and by `verify`."""
        return (self.scan.damage if self.scan is not None else []) + self._verified_damage

    def verify(self) -> list[str]:
        """Check every block of every segment against its digest (reads the whole log); returns
        the damage found (also added to `damage`)."""
        found = [d for s in self.segments for d in s.verify()]
        self._verified_damage = found
        return found

    def refresh(self) -> None:
        """Read the log again: shows what a live writer acknowledged (and sealed) since."""
        scan = self._scan(self._target, self._strict)
        self.close()
        fresh = self._from_scan(scan, self.note)
        self.segments, self.problems, self.scan = fresh.segments, fresh.problems, fresh.scan

    # -- samples --------------------------------------------------------------------------------
    def _locate(self, rows: np.ndarray) -> Iterator[tuple[Segment, np.ndarray]]:
        """(segment, sorted local rows) for sorted global rows; raises on rows no segment holds."""
        taken = 0
        for s in self.segments:
            lo = np.searchsorted(rows, s.first_row, side="left")
            hi = np.searchsorted(rows, s.first_row + s.num_rows, side="left")
            if hi > lo:
                taken += hi - lo
                yield s, rows[lo:hi] - s.first_row
        if taken != len(rows):
            held = np.zeros(len(rows), dtype=bool)
            for s in self.segments:
                held |= (rows >= s.first_row) & (rows < s.first_row + s.num_rows)
            bad = rows[~held]
            raise LogError(f"rows {bad[:10].tolist()} ({len(bad)} in all) are not in the readable "
                           f"log (0..{self.num_samples - 1}; problems: {self.problems or 'none'})")

    def read(self, rows: Iterable[int] | np.ndarray) -> SampleBatch:
        """The given global rows, in the given order (repeats allowed)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        uniq, inverse = np.unique(rows, return_inverse=True)
        parts = []
        for seg, local in self._locate(uniq):
            breaks = np.flatnonzero(np.diff(local) > _MERGE_GAP) + 1
            for run in np.split(local, breaks):
                a, b = int(run[0]), int(run[-1]) + 1
                batch = seg.read_range(a, b)
                parts.append(batch if len(run) == b - a else batch.take(run - a))
        out = SampleBatch.concat(parts) if parts else SampleBatch.empty(self.schema)
        same = len(rows) == len(uniq) and np.array_equal(rows, uniq)
        return out if same else out.take(inverse)

    def iter_batches(self, batch_size: int = 1024, min_version: int | None = None,
                     max_version: int | None = None,
                     steps: Iterable[int] | None = None) -> Iterator[SampleBatch]:
        """Samples in row order (or, with ``steps``, in step order), in batches of at most
        ``batch_size``; version bounds apply to each sample's oldest token version (inclusive)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")

        def keep(batch: SampleBatch) -> SampleBatch:
            if min_version is None and max_version is None:
                return batch
            v = batch.min_versions()
            mask = np.ones(len(v), dtype=bool)
            if min_version is not None:
                mask &= v >= min_version
            if max_version is not None:
                mask &= v <= max_version
            return batch if mask.all() else batch.take(np.flatnonzero(mask))

        if steps is not None:
            step_rows = self.step_rows()
            chosen = [step_rows[s] for s in sorted(set(int(s) for s in steps)) if s in step_rows]
            rows = np.concatenate(chosen) if chosen else np.zeros(0, np.int64)
            for i in range(0, len(rows), batch_size):
                batch = keep(self.read(rows[i:i + batch_size]))
                if len(batch):
                    yield batch
            return
        for seg in self.segments:
            for a in range(0, seg.num_rows, batch_size):
                batch = keep(seg.read_range(a, min(a + batch_size, seg.num_rows)))
                if len(batch):
                    yield batch

    def column(self, name: str, intact_only: bool = False) -> np.ndarray:
        """One committed column over all readable segments, e.g. ``samples/reward`` (row order);
        ``intact_only``: without the rows of its table in damaged blocks (`Segment.damaged_rows`),
        else damage raises `CorruptSegmentError`."""
        if not self.segments:
            spec = dataset_layout(self.schema)[name]
            return np.zeros((0, *spec.trail), spec.dtype)
        return np.concatenate([s.intact_column(name) if intact_only else s.read_column(name)
                               for s in self.segments])

    def rows(self, intact_only: bool = False) -> np.ndarray:
        """Global row id of every readable sample, in the order of `column('samples/...')`."""
        return np.concatenate([np.zeros(0, np.int64)] + [
            np.arange(s.first_row, s.first_row + s.num_rows, dtype=np.int64)[
                ~s.damaged_rows()["samples"] if intact_only else slice(None)]
            for s in self.segments])

    def min_versions(self) -> np.ndarray:
        """Oldest token version of every readable sample (row order)."""
        return np.concatenate([np.zeros(0, np.int32)] + [s.min_versions() for s in self.segments])

    # -- tables --------------------------------------------------------------------------------
    def groups(self, intact_only: bool = False) -> dict[str, np.ndarray]:
        return {c: self.column(f"groups/{c}", intact_only) for c in GROUP_COLUMNS}

    def steps(self, intact_only: bool = False) -> dict[str, np.ndarray]:
        return {c: self.column(f"steps/{c}", intact_only) for c in STEP_COLUMNS}

    def step_meta(self) -> dict[str, np.ndarray]:
        return {c: self.column(f"step_meta/{c}") for c in STEP_META_COLUMNS}

    def step_records(self, intact_only: bool = False) -> list[tuple[int, int, np.ndarray]]:
        """(step, trainer_step, rows) of every step record, in log order. ``intact_only``:
        leave out the records of a segment whose step tables are damaged, and records that do not
        match the rows they name (their count, their tokens); `resume_state` counts them."""
        out = []
        self.steps_lost_in: list[Segment] = []
        """Segments whose step records (some or all) `step_records(intact_only=True)` left out."""
        for seg in self.segments:
            if intact_only and (seg.damaged_rows()["steps"].any()
                                or seg.damaged_rows()["step_meta"].any()):
                self.steps_lost_in.append(seg)
                continue
            meta = seg.read_table("step_meta", ("step", "trainer_step", "n_samples", "n_tokens"))
            rows = seg.read_column("steps/row")
            ends = np.cumsum(meta["n_samples"], dtype=np.int64)
            if len(ends) and ends[-1] != len(rows):
                if intact_only:
                    self.steps_lost_in.append(seg)
                    continue
                raise CorruptSegmentError(f"{seg.path}: step_meta counts {int(ends[-1])} step rows "
                                          f"but steps holds {len(rows)}")
            starts = ends - meta["n_samples"]
            for s, v, a, b, t in zip(meta["step"], meta["trainer_step"], starts, ends,
                                     meta["n_tokens"]):
                if intact_only and not self._names_its_rows(rows[a:b], int(t)):
                    self.steps_lost_in.append(seg)
                    continue
                out.append((int(s), int(v), rows[a:b]))
        return out

    def _names_its_rows(self, rows: np.ndarray, n_tokens: int) -> bool:
        """A step record is valid when its rows exist and their tokens sum to its ``n_tokens``
        (rows lost to damage cannot be checked and are taken as named)."""
        if len(rows) and (rows.min() < 0 or rows.max() >= self.num_samples):
            return False
        tokens = self._row_tokens()
        known = rows[np.isin(rows, tokens[0])]
        if len(known) < len(rows):
            return True
        idx = np.searchsorted(tokens[0], known)
        return int(tokens[1][idx].sum()) == n_tokens

    def _row_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """(intact global rows, their prompt + completion tokens), computed once."""
        if getattr(self, "_tokens_cache", None) is None:
            rows = self.rows(intact_only=True)
            n = (self.column("samples/prompt_len", intact_only=True).astype(np.int64)
                 + self.column("samples/completion_len", intact_only=True))
            self._tokens_cache = (rows, n)
        return self._tokens_cache

    def step_rows(self) -> dict[int, np.ndarray]:
        """Step -> global rows it consumed, from the latest record of each step."""
        return {step: rows for step, _, rows in self.step_records()}

    def resume_state(self, verify: bool = True) -> ResumeState:
        """What a resuming orchestrator needs; damage is tolerated (the log is verified first):
        damaged rows and the rows a lost step record may have consumed are never buffered.
        ``verify=False`` (a summary of a log taken as intact) raises on damage instead."""
        found = self.verify() if verify else []
        g = self.groups(intact_only=verify)
        resolving = g["group_id"][~np.isin(g["outcome"], RELEASE_OUTCOMES)]
        duplicates = len(resolving) - len(np.unique(resolving))
        stored_mask = g["outcome"] == GroupOutcome.STORED
        stored_idx = np.flatnonzero(stored_mask)
        stored_idx = stored_idx[np.unique(g["group_id"][stored_idx], return_index=True)[1]]
        stored = {c: g[c][stored_idx] for c in ("group_id", "attempt", "first_row", "n_samples",
                                                "min_version")}
        resolved = {o: np.unique(g["group_id"][g["outcome"] == o]) for o in GroupOutcome}
        sample_groups = self.column("samples/group_id", intact_only=verify)
        max_gid = max([-1] + [int(a.max()) for a in (g["group_id"], sample_groups) if len(a)])
        records = self.step_records(intact_only=verify)
        step_rows: dict[int, np.ndarray] = {}
        trainer_steps: dict[int, int] = {}
        for step, trainer_step, rows in records:
            step_rows[step], trainer_steps[step] = rows, trainer_step
        consumed = (np.unique(np.concatenate(list(step_rows.values()))) if step_rows
                    else np.zeros(0, np.int64))
        last = max(step_rows, default=-1)
        intact = self.rows(intact_only=verify)
        damaged = np.setdiff1d(np.arange(self.num_samples, dtype=np.int64), intact)
        loss = self.scan.lost if self.scan is not None else None
        below = loss.withhold_below if loss is not None else 0
        for seg in self.steps_lost_in:  # step records left out: they may name any row before
            below = max(below, seg.first_row + seg.num_rows)
        withheld = np.setdiff1d(intact[intact < below], consumed)
        lost = loss.as_dict() if loss is not None else {}
        lost.update(damaged_blocks=len(found), withheld_rows=len(withheld),
                    doubtful_step_segments=len(set(id(x) for x in self.steps_lost_in)),
                    unreadable_rows=len(damaged))
        return ResumeState(
            num_samples=self.num_samples, stored=stored, resolved=resolved,
            counts={o.name.lower(): int((g["outcome"] == o).sum()) for o in GroupOutcome},
            max_group_id=max_gid, duplicate_groups=int(duplicates), step_rows=step_rows,
            consumed_rows=consumed, last_step=last, last_trainer_step=trainer_steps.get(last, -1),
            problems=list(self.problems) + found, damaged_rows=damaged, withheld_rows=withheld,
            lost=lost)


def warn_damaged(errors: list) -> None:
    for e in errors:
        warnings.warn(f"rollout log: {e}", LogDamageWarning, stacklevel=3)


def _check_same_run(first: Segment, other: Segment) -> None:
    if other.run_id != first.run_id:
        raise SchemaMismatchError(f"{other.path} belongs to run {other.run_id!r}, "
                                  f"{first.path} to run {first.run_id!r}")
    if other.schema != first.schema:
        raise SchemaMismatchError(f"{other.path} has record schema {other.schema}, "
                                  f"{first.path} has {first.schema}")
