"""Which files make up a rollout log now: the scan shared by its readers and its writer.

Invariants:

- the newest journal whose header entry is valid decides (layout in `format`, `journal`):
  its header lists the sealed segments of the log; its valid entries after the header are the rows
  not sealed yet, held in memory as one more `Segment`. Older journals are ignored (what they held
  was sealed into a listed segment before the newer header was written), so is a journal without a
  valid header (a writer stopped while claiming it) and every segment no header lists (a writer
  stopped before publishing it, or a stale writer fenced off by a newer one);
- a log with no journal at all is a layout-1 log: all its segments, in order;
- a listed segment that is missing or damaged is skipped and reported (its rows become a gap:
  later rows keep their numbers); a foreign file or a newer layout raises;
- a file vanishing during a scan (a rotation removed the journal it was reading) restarts it.

Worked example: ``segment-00000.h5`` (rows 0-99, seqs 1-10), ``segment-00002.h5`` (rows 100-139,
seqs 11-14), a stale ``segment-00003.h5`` and ``journal-00000004.tfj`` whose header lists [0, 2]
with start_seq 15, start_row 140, followed by flushes 15 and 16 of 8 rows each: the log is rows
0-155; segment 3 is reported as unlisted and ignored; the next flush is seq 17.
"""
from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeline.rollout_log.format import (
    SCHEMA_VERSION, SEGMENT_RE, TABLES, CorruptSegmentError, ForeignFileError, LogError,
    NewerSchemaError, NotHDF5Error, dataset_layout, segment_attrs, segment_name, stored_name)
from pipeline.rollout_log.journal import JOURNAL_RE, JournalRead, read_entries, read_journal
from pipeline.rollout_log.segment import ArrayFile, Segment
from pipeline.protocol.journal_entries import CarriedJournal, FlushEntry, JournalHeader
from pipeline.protocol.record import RecordSchema

_ATTEMPTS = 5


@dataclass
class LogScan:
    segments: list[Segment]
    """Sealed segments of the log, opened, in order (damaged ones left out)."""
    tail: Segment | None
    """The governing journal's valid flush entries (None if it holds none or is damaged)."""
    problems: list[str]
    """Damage and ignored files, one sentence each."""
    header: JournalHeader | None = None
    """The governing journal's header (None for a layout-1 log)."""
    journal: Path | None = None
    max_index: int = -1
    """Largest generation among journal and segment names (the next writer claims one above)."""
    next_seq: int = 1
    next_row: int = 0
    valid_end: int = 0
    """Where the governing journal's valid prefix ends (bytes)."""
    torn: str | None = None
    """Why the journal was read only up to ``valid_end`` (a write in progress, or a torn tail)."""
    last_entry_t: float | None = None
    """Writer's wall-clock time of the newest valid entry (header included)."""
    scanned_at: float = field(default_factory=time.time)
    errors: list[LogError] = field(default_factory=list)
    """The damaged segments' errors (also in ``problems``)."""
    carried: list[Segment] = field(default_factory=list)
    """Rows kept from damaged journals: the quarantined ones the header carries, then the
    governing journal's when it is damaged (one in-memory segment per run of intact entries)."""
    damaged: bool = False
    """The governing journal holds damage followed by valid entries (a writer quarantines it)."""
    lost: LogLoss = field(default_factory=lambda: LogLoss())
    governing_lost: LogLoss = field(default_factory=lambda: LogLoss())
    """What damage in the governing journal cost (part of ``lost``)."""
    lost_segments: list[dict] = field(default_factory=list)
    """What the header says of each listed segment that cannot be opened (kept listed: reported
    and counted by every later read)."""
    """What damaged journal entries cost (carried journals and the governing one)."""

    @property
    def damage(self) -> list[str]:
        """The problems that are damage (not a killed writer's leftovers, ignored by design)."""
        return [p for p in self.problems if not p.endswith(", ignored")]

    def close(self) -> None:
        for s in self.segments + self.carried + ([self.tail] if self.tail is not None else []):
            s.close()


@dataclass
class LogLoss:
    """What damaged journal entries cost. Worked example: flushes 7 (rows 40-47, one step record)
    and 8 (rows 48-51) lost between intact flushes: entries 2, rows 12, step_records 1 and
    withhold_below 52 (the lost step may have consumed any row below 52)."""
    entries: int = 0
    rows: int = 0
    step_records: int = 0
    withhold_below: int = 0
    segments: int = 0
    """Listed segments lost whole (missing, or HDF5 cannot open them): their step records with them."""
    """Rows below this that no intact step record names may have been consumed by a lost one."""

    def add(self, other: "LogLoss") -> None:
        self.segments += other.segments
        self.entries += other.entries
        self.rows += other.rows
        self.step_records += other.step_records
        self.withhold_below = max(self.withhold_below, other.withhold_below)

    def as_dict(self) -> dict:
        return {"lost_entries": self.entries, "lost_segments": self.segments, "lost_rows": self.rows,
                "lost_step_records": self.step_records, "withhold_below": self.withhold_below}


def scan_log(log_dir: Path, strict: bool = False) -> LogScan:
    """The log in ``log_dir`` as it is now (see module invariants); ``strict`` raises on damage."""
    for attempt in range(_ATTEMPTS):
        try:
            return _scan(Path(log_dir), strict)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ESTALE) or attempt == _ATTEMPTS - 1:
                raise
            time.sleep(0.05 * (attempt + 1))  # a rotation removed a file under us: scan again
    raise AssertionError("unreachable")


def open_segments(paths: list[Path], strict: bool,
                  known: list[dict] | None = None) -> tuple[list[Segment], list[LogError]]:
    """Open segments in order; damaged ones are skipped (their errors returned) unless ``strict``.
    ``known``: per path, what the journal header says of it (`Segment`); then a segment that looks
    foreign or newer is damaged too."""
    segments, errors = [], []
    damage = (NotHDF5Error, CorruptSegmentError) + ((ForeignFileError, NewerSchemaError) if known else ())
    try:
        for i, p in enumerate(paths):
            try:
                segments.append(Segment.open(p, known[i] if known else None))
            except damage as e:
                if strict:
                    raise
                errors.append(e)
    except BaseException:
        for s in segments:
            s.close()
        raise
    return segments, errors


def _scan(log_dir: Path, strict: bool) -> LogScan:
    names = os.listdir(log_dir)
    seg_index = {int(m.group(1)): log_dir / n for n in names if (m := SEGMENT_RE.match(n))}
    journals = sorted((int(m.group(1)), log_dir / n) for n in names if (m := JOURNAL_RE.match(n)))
    max_index = max([*seg_index, *(g for g, _ in journals)], default=-1)
    problems: list[str] = []
    lost_segments: list[dict] = []
    for gen, path in reversed(journals):
        jr = read_journal(path)
        if jr.entries:
            break
        problems.append(f"{path.name}: no valid header ({jr.cut or 'empty'}); a writer stopped "
                        "while claiming it, ignored")
    else:  # no governing journal: a layout-1 log (or one whose first writer never got going)
        segs, errors = open_segments([seg_index[i] for i in sorted(seg_index)], strict)
        return LogScan(segs, None, problems + [str(e) for e in errors], max_index=max_index,
                       next_row=max((s.first_row + s.num_rows for s in segs), default=0),
                       errors=errors)
    head = jr.entries[0]
    if head.layout > SCHEMA_VERSION:
        raise NewerSchemaError(f"{path}: written with log layout version {head.layout}; this "
                               f"Tokenflow reads versions <= {SCHEMA_VERSION} (upgrade it)")
    listed = [int(i) for i in head.arrays["segments"]]
    known = _listed_facts(head)
    missing = [CorruptSegmentError(f"{log_dir / segment_name(i)}: listed by {path.name} but "
                                   "missing") for i in listed if i not in seg_index]
    if missing and strict:
        raise missing[0]
    present = [k for k, i in enumerate(listed) if i in seg_index]
    segs, errors = open_segments([seg_index[listed[k]] for k in present], strict,
                                 [known[k] for k in present] if known else None)
    if known:  # rows of listed segments lost whole (missing or unopenable)
        opened = {s.index for s in segs}
        for k, i in enumerate(listed):
            if i not in opened:
                lost_segments.append(known[k])
    problems += [str(e) for e in missing + errors] + [n for seg in segs for n in seg.notes]
    problems += [f"{seg_index[i].name}: not listed by {path.name} (left by a writer that stopped "
                 "before publishing it, or by a fenced stale writer), ignored"
                 for i in sorted(set(seg_index) - set(listed))]
    flushes = jr.entries[1:]
    scan = LogScan(segs, None, problems, header=head, journal=path, max_index=max_index,
                   next_seq=flushes[-1].seq + 1 if flushes else head.start_seq,
                   valid_end=jr.valid_end, torn=jr.cut,
                   last_entry_t=_entry_time(jr.entries[-1], head),
                   errors=missing + errors)
    try:
        for c in head.carried:
            cpath = log_dir / c.file
            try:
                with open(cpath, "rb") as fh:
                    cjr = read_entries(fh.read(c.valid_end))
            except FileNotFoundError:
                if strict:
                    raise CorruptSegmentError(f"{cpath}: listed by {path.name} but missing")
                problems.append(f"{cpath.name}: quarantined journal listed by {path.name} but "
                                "missing; its rows are lost")
                continue
            problems += [f"{cpath.name} (quarantined): {d}" for d in cjr.damage]
            loss = LogLoss()
            if cjr.entries:
                scan.carried += journal_runs(cpath, cjr, strict, problems, loss)
            if c.lost_entries is not None:  # what its quarantine recorded (a damaged tail included)
                loss = LogLoss(c.lost_entries, c.lost_rows, c.lost_step_records, c.withhold_below,
                               c.lost_segments)
                problems.append(f"{cpath.name} (quarantined): damage lost {loss.entries} entries")
            scan.lost.add(loss)
        scan.damaged = bool(jr.damage)
        problems += [f"{path.name}: {d}" for d in jr.damage]
        runs = journal_runs(path, jr, strict, problems, scan.governing_lost)
        scan.lost.add(scan.governing_lost)
        if scan.damaged:
            scan.carried += runs
        elif runs:
            scan.tail = runs[0]
    except BaseException:
        scan.close()
        raise
    scan.lost_segments = lost_segments
    for facts in lost_segments:  # a lost segment's step records are lost with it
        scan.lost.segments += 1
        scan.lost.rows += facts["rows"]
        scan.lost.withhold_below = max(scan.lost.withhold_below, facts["first_row"] + facts["rows"])
    scan.next_row = max([head.start_row] + [s.first_row + s.num_rows for s in runs])
    if scan.lost.entries or scan.lost.segments:
        loss = scan.lost
        problems.append(f"damage cost {loss.entries} journal entries and {loss.segments} "
                        f"segment(s): {loss.rows} rows and {loss.step_records} step record(s) "
                        "(at least) lost" + (
                            f"; rows below {loss.withhold_below} that no intact step record names "
                            "are withheld from training (a lost step may have consumed them)"
                            if loss.withhold_below else ""))
    return scan


def _entry_time(entry: JournalHeader | FlushEntry, head: JournalHeader) -> float:
    """The writer's wall-clock time of a journal entry (a flush that did not record it: the header's)."""
    t = entry.created if isinstance(entry, JournalHeader) else entry.t
    return head.created if t is None else t


def _listed_facts(head: JournalHeader) -> list[dict] | None:
    """What a header says of each segment it lists (`Segment`); None for headers written before
    headers said it."""
    arrays = head.arrays
    if "segment_first_rows" not in arrays:
        return None
    schema = json.dumps(head.record_schema, sort_keys=True)
    return [{"first_row": int(r), "rows": int(n), "tokenflow_schema_version": int(v),
             "run_id": head.run_id, "record_schema": schema, "segment_index": int(i)}
            for i, r, n, v in zip(arrays["segments"], arrays["segment_first_rows"],
                                  arrays["segment_rows"], arrays["segment_layouts"])]


def journal_runs(path: Path, jr: JournalRead, strict: bool, problems: list[str],
                 lost: LogLoss) -> list[Segment]:
    """A journal's valid flush entries as in-memory segments, one per run of consecutive sequence
    numbers; what the entries missing between runs held is added to ``lost``."""
    head = jr.entries[0]
    runs: list[list[FlushEntry]] = []
    for f in jr.entries[1:]:
        if runs and f.seq == runs[-1][-1].seq + 1:
            runs[-1].append(f)
        else:
            runs.append([f])
    out: list[Segment] = []
    row_end, steps_end, seq_end = head.start_row, 0, head.start_seq
    for run in runs:
        m = run[0]
        first_row = row_end if m.row is None else m.row
        steps_at = steps_end if m.steps_at is None else m.steps_at
        if m.seq > seq_end:  # entries lost to damage before this run
            gap = LogLoss(m.seq - seq_end, first_row - row_end, steps_at - steps_end)
            gap.withhold_below = first_row if gap.step_records else 0
            lost.add(gap)
        seg = _run_segment(path, head, run, first_row, strict, problems)
        n_rows = sum(len(f.arrays["samples/prompt_len"]) for f in run)
        row_end, seq_end = first_row + n_rows, run[-1].seq + 1
        steps_end = steps_at + sum(len(f.arrays["step_meta/step"]) for f in run)
        if seg is not None:
            out.append(seg)
    if jr.damaged_tail:  # an entry of unknown content lost at the end: any row may be consumed
        lost.add(LogLoss(entries=1, withhold_below=row_end))
    return out


def _run_segment(path: Path, head: JournalHeader, flushes: list[FlushEntry], first_row: int,
                 strict: bool, problems: list[str]) -> Segment | None:
    """Consecutive flush entries' rows as one in-memory segment (under today's dataset names)."""
    schema = RecordSchema.from_dict(head.record_schema)
    layout = dataset_layout(schema)
    arrays = {name: np.concatenate([f.arrays[stored_name(name, head.layout)] for f in flushes])
              for name in layout}
    first = flushes[0]
    arrays["samples/prompt_offset"] = arrays["samples/prompt_offset"] - first.prompt_at
    arrays["samples/completion_offset"] = arrays["samples/completion_offset"] - first.completion_at
    counts = dict.fromkeys(TABLES, 0)  # (token offsets count from the run's first entry)
    for name, spec in layout.items():
        counts[spec.table] = len(arrays[name])
    attrs = segment_attrs(schema, head.run_id, head.gen, first_row, head.meta, first.seq,
                          flushes[-1].seq, head.writer)
    attrs["tokenflow_schema_version"] = head.layout
    attrs["meta"] = json.dumps(head.meta, sort_keys=True)
    seg = Segment(ArrayFile(arrays, attrs), path, counts=counts)
    try:
        bad = [n for n, s in layout.items() if len(arrays[n]) != counts[s.table]]
        if bad:
            raise CorruptSegmentError(f"{path}: journal entries disagree on table lengths ({bad})")
        seg.check_offsets(counts)
    except CorruptSegmentError as e:
        if strict:
            raise
        problems.append(str(e))
        return None
    return seg


def recorded_damage(log_dir: Path) -> list[str]:
    """The damage the newest journal header records (quarantined journals and what they cost),
    one sentence each; cheap (reads the header only), for `tokenflow status`."""
    journals = sorted((int(m.group(1)), log_dir / n) for n in os.listdir(log_dir)
                      if (m := JOURNAL_RE.match(n)))
    for _, path in reversed(journals):
        with open(path, "rb") as fh:
            jr = read_entries(fh.read(1 << 20))
        if jr.entries:
            return [_quarantine_note(c) for c in jr.entries[0].carried]
    return []


def _quarantine_note(c: CarriedJournal) -> str:
    if c.lost_entries is None:  # a quarantine that recorded no loss
        return f"{c.file} quarantined: ? journal entries, ? rows, ? step records lost"
    return (f"{c.file} quarantined: {c.lost_entries} journal entries, {c.lost_rows} rows, "
            f"{c.lost_step_records} step records lost")
