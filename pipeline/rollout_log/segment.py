"""One segment file of the rollout log: open it, check it is ours and whole, read its rows.

Invariants:

- a `Segment` only ever shows what a valid commit row covers (see `format`): data a writer
  wrote after its last complete flush is invisible, so readers of a live or a killed writer's
  segment see a consistent prefix;
- opening never modifies the file: read-only, plainly (so damage fails fast), and in SWMR read
  mode only for a layout-1 segment whose SWMR writer was killed;
- a `Segment` may also stand for rows held in memory (an `ArrayFile`: the journal's valid entries
  read by a reader, or the writer's unsealed rows), read through the same methods;
- every failure names the file: not HDF5 -> `NotHDF5Error`; no Tokenflow attributes ->
  `ForeignFileError`; newer layout -> `NewerSchemaError`; cut short or unreadable ->
  `CorruptSegmentError` (including read errors and invalid data found while reading rows).

Row numbers here are *local* (0 = the segment's first sample); ``first_row`` maps them to global rows.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from pipeline.rollout_log.format import (
    SCHEMA_VERSION, TABLES, CorruptSegmentError, ForeignFileError, NewerSchemaError, NotHDF5Error,
    dataset_layout)
from pipeline.protocol.record import PROMPT_COLUMN, RecordError, RecordSchema, SampleBatch

_COMMIT_LOOKBACK = 8  # how many trailing commit rows to try when the last one is torn
# A live (or killed mid-flush) SWMR writer's file may end up to this many bytes before the end
# its superblock records (space allocated, not yet written); a larger gap means the file was cut.
_SWMR_SLACK = 64 * 1024


class ArrayFile:
    """In-memory stand-in for an open segment file: ``arrays`` maps dataset paths (e.g.
    ``samples/reward``) to arrays at least as long as their table's count; ``arrays`` is used by
    reference, so a writer may replace a grown array in it."""

    def __init__(self, arrays: dict[str, np.ndarray], attrs: dict):
        self.arrays, self.attrs = arrays, attrs

    def __getitem__(self, name: str):
        if name in self.arrays:
            return self.arrays[name]
        prefix = name + "/"
        return {k[len(prefix):]: v for k, v in self.arrays.items() if k.startswith(prefix)}

    def close(self) -> None:
        pass


class Segment:
    """A segment opened for reading (by a reader, or by the writer on its own live file)."""

    def __init__(self, file, path: Path, counts: dict[str, int] | None = None):
        self.file, self.path = file, Path(path)
        a = file.attrs
        self.version = int(a["tokenflow_schema_version"])
        self.run_id = str(a["run_id"])
        self.schema = RecordSchema.from_dict(json.loads(a["record_schema"]))
        self.index = int(a["segment_index"])
        self.first_row = int(a["first_row"])
        self.created = float(a["created"])
        self.meta = json.loads(a["meta"])
        self.layout = dataset_layout(self.schema)
        self.counts = counts if counts is not None else self._committed_counts()

    @classmethod
    def open(cls, path: Path) -> "Segment":
        import h5py
        path = Path(path)
        if not h5py.is_hdf5(path):
            raise NotHDF5Error(f"{path}: not an HDF5 file (no HDF5 signature)")
        shortfall = _shortfall(path)
        truncated = CorruptSegmentError(f"{path}: truncated (the file ends {shortfall} bytes "
                                        "before the end its HDF5 superblock records)")
        try:  # a closed segment opens plainly: damage then fails fast instead of SWMR's retries
            f = h5py.File(path, "r")
        except OSError as plain_error:
            live = _marked_open_for_write(path)
            if shortfall > (_SWMR_SLACK if live else 0):
                raise truncated
            if not live:
                raise CorruptSegmentError(f"{path}: HDF5 cannot open it ({plain_error})")
            try:  # a live writer's segment, or one whose writer was killed
                f = h5py.File(path, "r", swmr=True)
            except OSError as e:
                raise CorruptSegmentError(f"{path}: HDF5 cannot open it ({e}); if it was written "
                                          "without SWMR, `h5clear -s` may recover it")
        else:
            if shortfall:
                f.close()
                raise truncated
        try:
            if "tokenflow_schema_version" not in f.attrs:
                raise ForeignFileError(f"{path}: an HDF5 file but not a Tokenflow rollout log "
                                       "(no tokenflow_schema_version attribute)")
            version = int(f.attrs["tokenflow_schema_version"])
            if version > SCHEMA_VERSION:
                raise NewerSchemaError(f"{path}: written with log layout version {version}; this "
                                       f"Tokenflow reads versions <= {SCHEMA_VERSION} (upgrade it)")
            try:
                return cls(f, path)
            except (KeyError, ValueError, OSError) as e:
                if isinstance(e, CorruptSegmentError):
                    raise
                raise CorruptSegmentError(f"{path}: damaged segment structure ({e})") from e
        except BaseException:
            f.close()
            raise

    # -- counts --------------------------------------------------------------------------------
    def _table_lengths(self) -> dict[str, int]:
        lengths = {t: np.iinfo(np.int64).max for t in TABLES}
        for name, spec in self.layout.items():
            lengths[spec.table] = min(lengths[spec.table], self.file[name].shape[0])
        return lengths

    def _committed_counts(self) -> dict[str, int]:
        """Counts of the last commit row that is whole and covered by the datasets' lengths."""
        commits = self.file["commits"]
        k = commits.shape[0]
        lengths = self._table_lengths()
        if k:
            tail = commits[max(0, k - _COMMIT_LOOKBACK):k]
            for j in range(len(tail) - 1, -1, -1):
                row, seq = tail[j], k - len(tail) + j + 1
                counts = dict(zip(TABLES, (int(v) for v in row[1:])))
                if row[0] == seq and all(0 <= counts[t] <= lengths[t] for t in TABLES):
                    self.check_offsets(counts)
                    return counts
            raise CorruptSegmentError(f"{self.path}: none of its last commit rows is valid")
        return dict.fromkeys(TABLES, 0)

    def check_offsets(self, counts: dict[str, int]) -> None:
        n = counts["samples"]
        if not n:
            return
        s = self.file["samples"]
        for kind, table, length in (("prompt", "prompt_tokens", "prompt_len"),
                                    ("completion", "completion_tokens", "completion_len")):
            end = int(s[f"{kind}_offset"][n - 1]) + int(s[length][n - 1])
            if end != counts[table]:
                raise CorruptSegmentError(f"{self.path}: {kind} tokens end at {end} but the "
                                          f"commit counts {counts[table]}")

    @property
    def num_rows(self) -> int:
        return self.counts["samples"]

    # -- reads ---------------------------------------------------------------------------------
    def read_range(self, a: int, b: int) -> SampleBatch:
        """Local rows ``a:b`` as a validated SampleBatch."""
        if not 0 <= a <= b <= self.num_rows:
            raise IndexError(f"{self.path}: rows {a}:{b} outside 0:{self.num_rows}")
        try:
            s = self.file["samples"]
            cols = {name: s[name][a:b] for name in self.schema.scalar_columns()}
            p0 = p1 = c0 = c1 = 0
            if b > a:
                p0, c0 = int(s["prompt_offset"][a]), int(s["completion_offset"][a])
                p1 = int(s["prompt_offset"][b - 1]) + int(cols["prompt_len"][-1])
                c1 = int(s["completion_offset"][b - 1]) + int(cols["completion_len"][-1])
            cols[PROMPT_COLUMN[0]] = s[PROMPT_COLUMN[0]][p0:p1]
            for name in self.schema.prompt_token_fields():
                cols[name] = s[name][p0:p1]
            for name in self.schema.token_fields():
                cols[name] = s[name][c0:c1]
            return SampleBatch(cols, self.schema, validate=True)
        except (OSError, RecordError) as e:
            raise CorruptSegmentError(f"{self.path}: rows {a}:{b} are damaged ({e})") from e

    def read_column(self, name: str, a: int = 0, b: int | None = None) -> np.ndarray:
        """Committed values of one dataset, e.g. ``samples/reward`` or ``groups/outcome``."""
        spec = self.layout.get(name)
        if spec is None:
            raise KeyError(f"no dataset {name} in a segment of schema {self.schema}")
        n = self.counts[spec.table]
        b = n if b is None else min(b, n)
        try:
            return self.file[name][a:b]
        except OSError as e:
            raise CorruptSegmentError(f"{self.path}: dataset {name} is damaged ({e})") from e

    def read_table(self, table: str, columns) -> dict[str, np.ndarray]:
        return {c: self.read_column(f"{table}/{c}") for c in columns}

    def min_versions(self, block_tokens: int = 1 << 22) -> np.ndarray:
        """Oldest token version of every committed sample, reading ``versions`` in blocks."""
        off = self.read_column("samples/completion_offset")
        out = np.empty(len(off), dtype=np.int32)
        ds = self.file["samples/versions"]
        i = 0
        while i < len(off):
            t0 = int(off[i])
            j = int(np.searchsorted(off, t0 + block_tokens, side="left"))
            j = max(j, i + 1)
            block = ds[t0:int(off[j - 1]) + 1]
            out[i:j] = block[off[i:j] - t0]
            i = j
        return out

    def close(self) -> None:
        self.file.close()


def _superblock_eof(path: Path) -> int | None:
    """End-of-file address recorded in the HDF5 superblock at offset 0 (None if unknown)."""
    with open(path, "rb") as fh:
        head = fh.read(64)
    if len(head) < 64 or head[:8] != b"\x89HDF\r\n\x1a\n":
        return None
    version = head[8]
    size_of_offsets = head[13] if version < 2 else head[9]
    at = {0: 24, 1: 28}.get(version, 12) + 2 * size_of_offsets
    if size_of_offsets not in (4, 8) or at + size_of_offsets > len(head):
        return None
    return int.from_bytes(head[at:at + size_of_offsets], "little")


def _marked_open_for_write(path: Path) -> bool:
    """Whether the superblock (version >= 2) says a writer still has the file open: a layout-1
    SWMR segment whose writer was killed. Sealed segments are closed before they are named."""
    with open(path, "rb") as fh:
        head = fh.read(12)
    return len(head) == 12 and head[8] >= 2 and bool(head[11] & 0x05)


def _shortfall(path: Path) -> int:
    """Bytes missing between the file's size and the end its superblock records (0 if none)."""
    eof = _superblock_eof(path)
    return max(0, eof - os.path.getsize(path)) if eof is not None else 0
