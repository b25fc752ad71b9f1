"""Writer of the durable rollout log (layout in `format`, journal in `journal`).

Invariants:

- `flush` writes everything appended since the last flush as ONE journal entry (sequence number +
  checksum) and returns after ``fdatasync``: then, and only then, it is durable on the log
  directory's filesystem (local disk, NFS, Lustre, GPFS) and visible to readers on any node; a
  ``kill -9`` (or node crash) loses only appends not yet flushed. The orchestrator acknowledges a
  result after the flush that covers it, grouping every result of a turn into one flush;
- every ``seal_interval_s`` (or ``seal_bytes`` of journal), and at `close`, the journal's rows are
  sealed into an immutable HDF5 segment and the next journal generation is started (claimed with an
  exclusive create; its header lists the segments); a writer killed at any point leaves a log that
  the next start reads whole: sealed segments, then the journal's valid prefix;
- a start never modifies an existing file: it reads the log (`scan`), refuses a foreign file, a
  newer layout, another run id or record schema; checks that the filesystem can give durability
  (`check_log_filesystem`); claims the next generation; seals the predecessor's unsealed rows into
  that generation's segment; writes a header recording where the predecessor's journal validly
  ends (``predecessor``), then removes older journals. Anything a stale writer appends after that
  point is ignored by every reader; its next flush after ``FENCE_CHECK_S`` finds its journal
  removed, or its next seal finds its generation taken, and raises `LogFencedError` (no file locks:
  they are not trustworthy on network filesystems);
- the log's first new row is where the readable log ended, so rows handed out never change meaning.

Metadata load: a flush is one write + ``fdatasync`` of an open file (no namespace operation; at
most one ``fstat`` a second); a seal is ~8 (create, rename, directory fsync x2, exclusive create, remove)
and a data sync per `SEAL_SYNC_BYTES` it writes. With the defaults (``flush_interval_s`` 0.02,
``seal_interval_s`` 60, ``seal_bytes`` 256 MiB) a busy run sends at most ~3000 flush syncs (and
<= 64 a seal) and ~8 namespace operations per minute to the filesystem (docs/rollout-log.md).

Worked example: a log whose segments hold 140 rows and whose journal holds 2 valid flushes of 8 rows
(seqs 15, 16) plus a torn third one: a start seals rows 140-155 into its segment, its header says
start_seq 17, start_row 156 and that the predecessor's journal validly ended before the torn entry;
``append_samples`` of a 3-sample batch then returns rows [156, 157, 158].
"""
from __future__ import annotations

import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline.rollout_log.format import (
    GROUP_COLUMNS, SCHEMA_VERSION, STEP_COLUMNS, STEP_META_COLUMNS, TABLES,
    GroupOutcome, LogError, LogFullError,
    LogDamageWarning, LogFencedError, SchemaMismatchError, check_log_filesystem, dataset_layout,
    segment_attrs, segment_name, write_sealed_segment)
from pipeline.rollout_log.journal import (
    JournalFile, copy_aside, encode_entry, fsync_dir, journal_name, list_journals)
from pipeline.rollout_log.pending import PendingAppends
from pipeline.rollout_log.reader import RolloutLog
from pipeline.rollout_log.scan import scan_log
from pipeline.rollout_log.segment import ArrayFile, Segment
from pipeline.rollout_log.write_checks import cast_column, check_matches, disk_full
from pipeline.protocol.journal_entries import CarriedJournal, FlushEntry, JournalHeader, Predecessor
from pipeline.protocol.record import PROMPT_COLUMN, RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.protocol.wire import Pieces


ArrayLike = int | float | Sequence | np.ndarray
#: How often (at most) a flush checks that no newer writer has taken over (one fstat).
FENCE_CHECK_S = 1.0


class RolloutLogWriter:
    """Appends samples, resolved groups and step records to a run's rollout log."""

    def __init__(self, log_dir: Path, schema: RecordSchema, run_id: str, meta: dict | None = None,
                 *, seal_interval_s: float = 60.0, seal_bytes: int = 256 << 20):
        """``log_dir`` is ``RUN/rollouts``; ``meta`` (JSON-able) is stored in every new segment and
        journal header; a seal happens every ``seal_interval_s`` or ``seal_bytes`` of journal."""
        if seal_interval_s <= 0 or seal_bytes <= 0:
            raise ValueError("seal_interval_s and seal_bytes must be > 0")
        self.log_dir, self.schema, self.run_id = Path(log_dir), schema, run_id
        self.meta, self.seal_interval_s, self.seal_bytes = meta or {}, seal_interval_s, seal_bytes
        self.fstype = check_log_filesystem(self.log_dir)
        import h5py  # noqa: F401 - the seal's library, loaded with the writer (not by its first seal)
        self._full: LogFullError | None = None
        self.writer_id = uuid.uuid4().hex[:16]
        scan = scan_log(self.log_dir)
        self._sealed: list[Segment] = list(scan.segments)
        self._journal: JournalFile | None = None
        self._carried_segs: list[Segment] = list(scan.carried)
        self._lost_listed = [(f["segment_index"], f["first_row"], f["rows"],
                              f["tokenflow_schema_version"]) for f in scan.lost_segments]
        self._carried: list[CarriedJournal] = list(scan.header.carried) if scan.header else []
        try:
            old = scan.segments + scan.carried + ([scan.tail] if scan.tail is not None else [])
            for seg in old:
                check_matches(seg, schema, run_id)
            self.problems = list(scan.problems)
            if scan.torn and scan.valid_end:
                self.problems.append(f"{scan.journal.name}: ignored after byte {scan.valid_end} "
                                     f"({scan.torn})")
            for p in self.problems:
                warnings.warn(f"rollout log: {p}", LogDamageWarning, stacklevel=2)
            self._layout = dataset_layout(schema)
            self._sample_columns = (*schema.scalar_columns(), PROMPT_COLUMN[0],
                                    *schema.prompt_token_fields(), *schema.token_fields())
            self._chunks: dict[str, list[np.ndarray]] = {n: [] for n in self._layout}
            self._arrays: dict[str, np.ndarray] = {}  # _chunks joined, when a read or seal needs it
            self._written = dict.fromkeys(TABLES, 0)  # this generation's flushed counts
            self._pending = PendingAppends(self._layout)
            self.first_row = scan.next_row
            self.seq = scan.next_seq
            self._row_tokens = np.zeros(max(1024, 2 * self.first_row), dtype=np.int64)
            for seg in old:  # prompt + completion tokens of every row, for step records' n_tokens
                self._row_tokens[seg.first_row:seg.first_row + seg.num_rows] = seg.row_tokens()
            predecessor = None if scan.header is None else Predecessor(
                scan.header.gen, scan.header.writer, scan.valid_end, scan.next_seq - 1, scan.torn)
            tail = scan.tail
            if scan.damaged:
                self._carried.append(_quarantine(scan))
            self._rotate(scan.max_index + 1, {n: [a] for n, a in (tail.file.arrays if tail else {}).items()},
                         tail.counts if tail else dict.fromkeys(TABLES, 0),
                         tail.first_row if tail else self.first_row,
                         scan.header.start_seq if tail else self.seq, predecessor)
        except FileExistsError:
            self._release(scan.tail)
            raise LogError(f"{self.log_dir}: another rollout log writer is starting on this log")
        except BaseException:
            self._release(scan.tail)
            raise
        if scan.tail is not None:
            scan.tail.close()
        self._log = RolloutLog(self._sealed + self._carried_segs + [self._live], self.problems)
        self._closed = False

    def _release(self, tail: Segment | None) -> None:
        for seg in self._sealed + self._carried_segs + ([tail] if tail is not None else []):
            seg.close()
        if self._journal is not None:
            self._journal.close()

    @property
    def path(self) -> Path:
        """The journal this writer appends to now."""
        return self._journal.path

    # -- generations --------------------------------------------------------------------------
    def _rotate(self, gen: int, data: dict, counts: dict[str, int], first_row: int,
                first_seq: int, predecessor: Predecessor | None = None) -> None:
        """Claim generation ``gen``, seal ``data`` (flushed rows not yet in a segment, per dataset
        in pieces: this generation's flushed chunks) into its segment, write its journal header,
        then drop older journals (module invariants)."""
        try:
            journal = JournalFile(self.log_dir / journal_name(gen))
        except OSError as e:
            if not isinstance(e, FileExistsError) and disk_full(e):
                raise self._stop_full(f"claiming generation {gen}", e) from e
            if not isinstance(e, FileExistsError):
                raise
            if self._journal is None:
                raise
            raise LogFencedError(
                f"{self.log_dir}: another writer took over this rollout log (it claimed "
                f"{journal_name(gen)}); this writer's flushes since sequence {first_seq} are not "
                "part of the log")
        sealed = None
        try:
            if any(counts.values()):
                path = self.log_dir / segment_name(gen)
                write_sealed_segment(path, self.schema, segment_attrs(
                    self.schema, self.run_id, gen, first_row, self.meta, first_seq, self.seq - 1,
                    self.writer_id), data, counts)
                sealed = path
                self._sealed.append(Segment.open(path))
            listed = sorted([(s.index, s.first_row, s.num_rows, s.version) for s in self._sealed]
                            + self._lost_listed)
            head = JournalHeader(
                SCHEMA_VERSION, self.run_id, gen, self.schema.to_dict(), self.writer_id, self.seq,
                first_row + counts["samples"], self.meta, time.time(), predecessor, self._carried, {
                    name: np.array([entry[k] for entry in listed], np.int64).reshape(-1)
                    for k, name in enumerate(("segments", "segment_first_rows", "segment_rows",
                                              "segment_layouts"))})
            header = encode_entry(head)
            journal.append(header + header)  # and its copy (see `journal`)
            fsync_dir(self.log_dir)
        except BaseException as e:  # withdraw the claim: nothing of this generation is acknowledged
            journal.close()
            journal.path.unlink(missing_ok=True)  # (what it would seal is still in the old journal)
            if sealed is not None:
                if self._sealed and self._sealed[-1].path == sealed:
                    self._sealed.pop().close()
                sealed.unlink(missing_ok=True)
            if disk_full(e):
                raise self._stop_full(f"sealing generation {gen}", e) from e
            raise
        if self._journal is not None:
            self._journal.close()
        self._journal, self.gen = journal, gen
        for old_gen, old in list_journals(self.log_dir):
            if old_gen < gen:
                old.unlink(missing_ok=True)  # sealed, or a fenced writer's: no reader needs it
        for tmp in self.log_dir.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)  # a killed (or fenced) writer's unfinished seal or copy
        self._gen_first_row, self._gen_first_seq = head.start_row, self.seq
        self._journal_bytes = 0
        self._sealed_at = self._fence_checked_at = time.monotonic()
        self._written.update(dict.fromkeys(TABLES, 0))
        for name, spec in self._layout.items():
            self._chunks[name] = []
            self._arrays[name] = np.zeros((0, *spec.trail), spec.dtype)
        self._live = Segment(ArrayFile(self._arrays, segment_attrs(
            self.schema, self.run_id, gen, head.start_row, self.meta)), journal.path,
            counts=self._written)
        if hasattr(self, "_log"):
            self._log.segments = self._sealed + self._carried_segs + [self._live]

    # -- appends (buffered) -------------------------------------------------------------------
    def append_samples(self, *batches: SampleBatch) -> np.ndarray:
        """Buffer batches of samples, in order, in one pass; returns the global row ids (int64) of
        their samples one after another. The arrays are kept by reference until the next seal:
        do not modify them in place."""
        self._check_open()
        for batch in batches:
            if batch.schema is not self.schema and batch.schema != self.schema:
                raise SchemaMismatchError(f"batch has record schema {batch.schema}, the log {self.schema}")
        cols = [b.columns for b in batches if len(b)]
        n = sum(len(c["group_id"]) for c in cols)
        rows = np.arange(self.num_rows, self.num_rows + n, dtype=np.int64)
        if not n:
            return rows
        lens = {k: np.concatenate([c[k] for c in cols]).astype(np.int64) for k in ("prompt_len", "completion_len")}
        for table, length, off_name in (("prompt_tokens", "prompt_len", "prompt_offset"),
                                        ("completion_tokens", "completion_len", "completion_offset")):
            ends = np.cumsum(lens[length]) + (self._written[table] + self._pending.counts[table])
            self._pending.push("samples", {off_name: [ends - lens[length]]}, 0)
            self._pending.counts[table] = int(ends[-1]) - self._written[table]
        self._pending.push("samples", {name: [c[name] for c in cols] for name in self._sample_columns}, n)
        if rows[-1] >= len(self._row_tokens):  # grown to at least twice its length
            grow = max(len(self._row_tokens), rows[-1] + 1 - len(self._row_tokens))
            self._row_tokens = np.concatenate((self._row_tokens, np.zeros(grow, np.int64)))
        self._row_tokens[rows] = lens["prompt_len"] + lens["completion_len"]
        return rows

    def append_groups(self, group_id: ArrayLike, attempt: ArrayLike, outcome: ArrayLike,
                      first_row: ArrayLike, n_samples: ArrayLike, min_version: ArrayLike,
                      t: ArrayLike) -> None:
        """Buffer resolved groups: each argument is a scalar or an array (broadcast together);
        ``outcome`` holds `GroupOutcome` codes, ``first_row`` is -1 for groups not stored."""
        self._check_open()
        values = dict(zip(GROUP_COLUMNS, np.broadcast_arrays(
            *map(np.atleast_1d, (group_id, attempt, outcome, first_row, n_samples, min_version, t)))))
        cols = {k: cast_column(f"groups.{k}", values[k], d) for k, d in GROUP_COLUMNS.items()}
        if not np.isin(cols["outcome"], [int(o) for o in GroupOutcome]).all():
            raise LogError(f"groups.outcome holds codes outside GroupOutcome: {values['outcome']}")
        fr = cols["first_row"]
        if ((fr < -1) | (fr >= self.num_rows)).any():
            raise LogError(f"groups.first_row {fr.tolist()} outside -1..{self.num_rows - 1}")
        self._pending.push("groups", {k: [v] for k, v in cols.items()})

    def append_steps(self, step: int, rows: ArrayLike, dp_ranks: ArrayLike, trainer_step: int,
                     t: float) -> None:
        """Buffer one step record: the global ``rows`` step ``step`` consumed, the data-parallel
        rank each went to (``dp_ranks``: one per row, or a scalar) and the trainer's step when
        it was served (`PolicyClock.trainer_step`)."""
        self._check_open()
        rows = cast_column("steps.row", np.atleast_1d(rows), STEP_COLUMNS["row"])
        if rows.ndim != 1 or (len(rows) and (rows.min() < 0 or rows.max() >= self.num_rows)):
            raise LogError(f"step {step}: rows must be 1-d within 0..{self.num_rows - 1}")
        ranks = cast_column("steps.dp_rank", np.broadcast_to(dp_ranks, rows.shape), STEP_COLUMNS["dp_rank"])
        self._pending.push("steps", {"step": [np.full(len(rows), step, STEP_COLUMNS["step"])],
                                     "row": [rows], "dp_rank": [ranks]})
        self._pending.push("step_meta", {
            "step": [np.array([step], STEP_META_COLUMNS["step"])],
            "trainer_step": [np.array([trainer_step], STEP_META_COLUMNS["trainer_step"])],
            "n_samples": [np.array([len(rows)], STEP_META_COLUMNS["n_samples"])],
            "n_tokens": [np.array([self._row_tokens[rows].sum()], STEP_META_COLUMNS["n_tokens"])],
            "t": [np.array([t], STEP_META_COLUMNS["t"])]})

    # -- flush and reads ----------------------------------------------------------------------
    def flush(self) -> None:
        """Journal everything appended so far as one entry, ``fdatasync``'d (module invariants);
        seals when the cadence is due."""
        self._check_open()
        if not any(self._pending.counts.values()):
            return
        entry = self._pending.joined()  # one chunk (or its pieces) per dataset, copied only where small
        parts = encode_entry(FlushEntry(
            self.seq, time.time(), self._gen_first_row + self._written["samples"],
            self._written["prompt_tokens"], self._written["completion_tokens"],
            self._written["step_meta"], entry))
        try:
            self._journal.append(parts)  # raises before anything below: nothing half-written
        except OSError as e:
            if disk_full(e):
                raise self._stop_full(f"flush {self.seq}", e) from e
            raise
        self.seq += 1
        self._journal_bytes += sum(memoryview(p).nbytes for p in parts)
        for name, chunk in entry.items():
            self._chunks[name] += chunk.parts if isinstance(chunk, Pieces) else [chunk]
        for table in TABLES:
            self._written[table] += self._pending.counts[table]
        self._pending.clear()
        if time.monotonic() - self._fence_checked_at >= FENCE_CHECK_S:
            self._check_not_fenced()
        if (self._journal_bytes >= self.seal_bytes
                or time.monotonic() - self._sealed_at >= self.seal_interval_s):
            self._seal()

    def _stop_full(self, what: str, e: BaseException) -> LogFullError:
        """Stop this writer: its filesystem is full (`LogFullError`, naming what is durable)."""
        self._full = LogFullError(
            f"{self.log_dir}: no space left on the rollout log's filesystem ({what} failed: {e}); "
            f"this writer stopped. Everything acknowledged (flushes up to sequence {self.seq - 1}) "
            "is durable and nothing is half-written: free space, then start again to resume")
        return self._full

    def _check_not_fenced(self) -> None:
        """A newer writer removes this writer's journal once its own header is durable: then
        this flush must not be acknowledged (one ``fstat`` of the open journal)."""
        self._fence_checked_at = time.monotonic()
        try:
            gone = os.fstat(self._journal.fd).st_nlink == 0
        except OSError as e:  # NFS: ESTALE once another client removed the file
            gone, why = True, str(e)
        else:
            why = "its journal was removed"
        if gone:
            raise LogFencedError(f"{self.path}: another writer took over this rollout log ({why}); "
                                 f"this writer's flush {self.seq - 1} and later ones are not part "
                                 "of the log")

    def seal(self) -> None:
        """Flush, then seal the journal's rows into a segment now and start the next generation
        (an error leaves everything flushed in the journal: a restart seals it)."""
        self.flush()
        self._seal()

    def _seal(self) -> None:
        if any(self._written.values()):
            self._rotate(self.gen + 1, self._chunks, dict(self._written), self._gen_first_row,
                         self._gen_first_seq)
        else:
            self._sealed_at = time.monotonic()

    @property
    def num_rows(self) -> int:
        """Next global row id (counts buffered, not yet flushed samples)."""
        return self._gen_first_row + self._written["samples"] + self._pending.counts["samples"]

    def read_samples(self, rows: ArrayLike) -> SampleBatch:
        """Samples at global ``rows`` (sealed or not; flushes first if some are only buffered)."""
        self._check_open()
        rows = np.atleast_1d(np.asarray(rows, dtype=np.int64))
        if len(rows) and rows.max() >= self._gen_first_row + self._written["samples"]:
            self.flush()
        if len(rows) and rows.max() >= self._gen_first_row:
            self._joined()
        return self._log.read(rows)

    def _joined(self) -> dict[str, np.ndarray]:
        """This generation's flushed chunks as one array per dataset (also what the live segment
        reads); joined only when a read of unsealed rows needs it (a seal writes the chunks)."""
        for name, chunks in self._chunks.items():
            if len(chunks) > 1:
                chunks[:] = [np.concatenate(chunks)]
            if chunks:
                self._arrays[name] = chunks[0]
        return self._arrays

    def close(self) -> None:
        """Flush, seal what the journal holds, close every file (after a `LogFullError`: only
        close; the next start seals what the journal holds)."""
        if self._closed:
            return
        try:
            if self._full is None:
                self.seal()
        finally:
            self._closed = True
            self._release(None)

    def __enter__(self) -> "RolloutLogWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._full is not None:
            raise self._full
        if self._closed:
            raise LogError(f"the rollout log writer of {self.log_dir} is closed")


def _quarantine(scan) -> CarriedJournal:
    """Copy the governing journal, damaged, aside (`journal.copy_aside`: never removed, carried by
    every later header so its intact entries stay in the log); what the header records of it."""
    try:
        dst = copy_aside(scan.journal)
    except OSError as e:
        if disk_full(e):
            raise LogFullError(f"{scan.journal.parent}: no space left to copy the damaged "
                               f"{scan.journal.name} aside ({e}); free space, then start again") from e
        raise
    return CarriedJournal(dst.name, scan.header.gen, scan.valid_end, **scan.governing_lost.as_dict())
