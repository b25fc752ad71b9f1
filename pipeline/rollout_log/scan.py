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
    SCHEMA_VERSION, SEGMENT_RE, TABLES, CorruptSegmentError, LogError, NewerSchemaError,
    NotHDF5Error, dataset_layout, segment_attrs, segment_name)
from pipeline.rollout_log.journal import JOURNAL_RE, read_journal
from pipeline.rollout_log.segment import ArrayFile, Segment
from pipeline.protocol.record import RecordSchema

_ATTEMPTS = 5


@dataclass
class LogScan:
    segments: list[Segment]
    """Sealed segments of the log, opened, in order (damaged ones left out)."""
    tail: Segment | None
    """The governing journal's valid flush entries (None if it holds none)."""
    problems: list[str]
    """Damage and ignored files, one sentence each."""
    header: dict | None = None
    """Meta of the governing journal's header (None for a layout-1 log)."""
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

    def close(self) -> None:
        for s in self.segments + ([self.tail] if self.tail is not None else []):
            s.close()


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


def open_segments(paths: list[Path], strict: bool) -> tuple[list[Segment], list[LogError]]:
    """Open segments in order; damaged ones are skipped (their errors returned) unless ``strict``."""
    segments, errors = [], []
    try:
        for p in paths:
            try:
                segments.append(Segment.open(p))
            except (NotHDF5Error, CorruptSegmentError) as e:
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
    head = jr.entries[0].meta
    if int(head.get("layout", 0)) > SCHEMA_VERSION:
        raise NewerSchemaError(f"{path}: written with log layout version {head['layout']}; this "
                               f"Tokenflow reads versions <= {SCHEMA_VERSION} (upgrade it)")
    listed = [int(i) for i in jr.entries[0].arrays["segments"]]
    missing = [CorruptSegmentError(f"{log_dir / segment_name(i)}: listed by {path.name} but "
                                   "missing") for i in listed if i not in seg_index]
    if missing and strict:
        raise missing[0]
    segs, errors = open_segments([seg_index[i] for i in listed if i in seg_index], strict)
    problems += [str(e) for e in missing + errors]
    problems += [f"{seg_index[i].name}: not listed by {path.name} (left by a writer that stopped "
                 "before publishing it, or by a fenced stale writer), ignored"
                 for i in sorted(set(seg_index) - set(listed))]
    flushes = jr.entries[1:]
    scan = LogScan(segs, None, problems, header=head, journal=path, max_index=max_index,
                   next_seq=int(head["start_seq"]) + len(flushes), valid_end=jr.valid_end,
                   torn=jr.cut, last_entry_t=float(jr.entries[-1].meta.get("t", head["created"])),
                   errors=missing + errors)
    scan.tail = _tail_segment(path, head, flushes, strict, problems)
    scan.next_row = int(head["start_row"]) + (scan.tail.num_rows if scan.tail else 0)
    return scan


def _tail_segment(path: Path, head: dict, flushes: list, strict: bool,
                  problems: list[str]) -> Segment | None:
    """The flush entries' rows as one in-memory segment."""
    if not flushes:
        return None
    schema = RecordSchema.from_dict(head["record_schema"])
    layout = dataset_layout(schema)
    arrays = {name: np.concatenate([f.arrays[name] for f in flushes]) for name in layout}
    counts = dict.fromkeys(TABLES, 0)
    for name, spec in layout.items():
        counts[spec.table] = len(arrays[name])
    attrs = segment_attrs(schema, head["run_id"], int(head["gen"]), int(head["start_row"]),
                          head["meta"], int(head["start_seq"]), int(head["start_seq"]) + len(flushes) - 1,
                          head["writer"])
    attrs["tokenflow_schema_version"] = int(head["layout"])
    attrs["meta"] = json.dumps(head["meta"], sort_keys=True)
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
