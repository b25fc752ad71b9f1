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
from pathlib import Path

import numpy as np

from pipeline.rollout_log.digests import BlockDamage, damaged_blocks, verified
from pipeline.rollout_log.hdf5_superblock import marked_open_for_write, shortfall as superblock_shortfall
from pipeline.rollout_log.segment_map import MappedFile, hdf5_damage
from pipeline.rollout_log.format import (
    SCHEMA_VERSION, TABLES, CorruptSegmentError, ForeignFileError, LogError, NewerSchemaError,
    NotHDF5Error, dataset_layout, stored_name)
from pipeline.protocol.record import PROMPT_COLUMN, RecordError, RecordSchema
from pipeline.protocol.sample_batch import SampleBatch

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

    def __init__(self, file, path: Path, counts: dict[str, int] | None = None,
                 known: dict | None = None):
        """``known``: what the journal header that lists this segment says of it (``first_row``,
        ``rows``, ``tokenflow_schema_version``, ``run_id``, ``record_schema``); it wins over the
        file's own attributes, so damaged attributes cannot move or misread rows."""
        self.file, self.path = file, Path(path)
        a = _Attrs(file.attrs, known or {})
        self.version = int(a["tokenflow_schema_version"])
        self.run_id = str(a["run_id"])
        self.schema = RecordSchema.from_dict(json.loads(a["record_schema"]))
        self.index = int(a["segment_index"])
        self.first_row = int(a["first_row"])
        self.created = float(a["created"])
        self.meta = json.loads(a["meta"])
        self.layout = dataset_layout(self.schema)
        self.digested = not isinstance(file, ArrayFile) and self.version >= 3
        """Sealed with digests: every read is checked (`digests`); in-memory rows were checked
        by their journal entries' checksums."""
        self._damaged_rows: dict[str, np.ndarray] | None = None
        self.notes: list[str] = []
        """Damage found that cost no rows (a damaged map or HDF5 metadata), one sentence each."""
        self.counts = counts if counts is not None else self._committed_counts()
        if known and "rows" in known and self.counts["samples"] != known["rows"]:
            raise CorruptSegmentError(f"{self.path}: holds {self.counts['samples']} rows, the "
                                      f"journal header lists {known['rows']}")

    @classmethod
    def open(cls, path: Path, known: dict | None = None) -> "Segment":
        """Open a segment file (``known``: see `__init__`). A listed sealed segment (layout >= 3)
        is read through its map (`segment_map`), so damaged HDF5 metadata costs nothing; HDF5
        reads it when the map is damaged."""
        import h5py
        path = Path(path)
        map_note = None
        if known is not None and int(known.get("tokenflow_schema_version", 0)) >= 3:
            try:
                mapped = MappedFile(path)
            except (OSError, ValueError) as e:
                map_note = f"{path}: its map is damaged ({e}); read through HDF5"
            else:
                try:
                    return cls(mapped, path, known=known)
                except CorruptSegmentError:
                    mapped.close()
                    raise
                except Exception as e:  # a map that names impossible places
                    mapped.close()
                    map_note = f"{path}: its map is damaged ({e}); read through HDF5"
        seg = cls._open_hdf5(path, known)
        if map_note:
            seg.notes.append(map_note)
        return seg

    @classmethod
    def _open_hdf5(cls, path: Path, known: dict | None) -> "Segment":
        import h5py
        if not h5py.is_hdf5(path):
            raise NotHDF5Error(f"{path}: not an HDF5 file (no HDF5 signature)")
        shortfall = superblock_shortfall(path)
        truncated = CorruptSegmentError(f"{path}: truncated (the file ends {shortfall} bytes "
                                        "before the end its HDF5 superblock records)")
        try:  # a closed segment opens plainly: damage then fails fast instead of SWMR's retries
            f = h5py.File(path, "r")
        except Exception as plain_error:  # OSError, and others on damaged metadata
            live = marked_open_for_write(path)
            if shortfall > (_SWMR_SLACK if live else 0):
                raise truncated
            if not live:
                raise CorruptSegmentError(f"{path}: HDF5 cannot open it ({plain_error})")
            try:  # a live writer's segment, or one whose writer was killed
                f = h5py.File(path, "r", swmr=True)
            except Exception as e:
                raise CorruptSegmentError(f"{path}: HDF5 cannot open it ({e}); if it was written "
                                          "without SWMR, `h5clear -s` may recover it")
        else:
            if shortfall:  # (HDF5 may hang reading a cut file)
                f.close()
                raise truncated
        try:
            if known is None and "tokenflow_schema_version" not in f.attrs:
                raise ForeignFileError(f"{path}: an HDF5 file but not a Tokenflow rollout log "
                                       "(no tokenflow_schema_version attribute)")
            version = int(_Attrs(f.attrs, known or {})["tokenflow_schema_version"])
            if version > SCHEMA_VERSION:
                raise NewerSchemaError(f"{path}: written with log layout version {version}; this "
                                       f"Tokenflow reads versions <= {SCHEMA_VERSION} (upgrade it)")
            try:
                return cls(f, path, known=known)
            except CorruptSegmentError:
                raise
            except Exception as e:  # h5py/HDF5 raise many types on damaged metadata
                raise CorruptSegmentError(f"{path}: damaged segment structure ({e})") from e
        except LogError:
            f.close()
            raise
        except Exception as e:
            f.close()
            raise CorruptSegmentError(f"{path}: damaged segment attributes ({e})") from e
        except BaseException:
            f.close()
            raise

    # -- counts --------------------------------------------------------------------------------
    def _table_lengths(self) -> dict[str, int]:
        lengths = {t: np.iinfo(np.int64).max for t in TABLES}
        for name, spec in self.layout.items():
            lengths[spec.table] = min(lengths[spec.table], self.file[self._stored(name)].shape[0])
        return lengths

    def _committed_counts(self) -> dict[str, int]:
        """Counts of the last commit row that is whole and covered by the datasets' lengths (a
        sealed segment with digests holds exactly its commit's rows: its datasets' lengths)."""
        lengths = self._table_lengths()
        if self.digested:
            return lengths  # the commit row is checked with the other blocks (`verify`)
        commits = self.file["commits"]
        k = commits.shape[0]
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
        for kind, table, length in (("prompt", "prompt_tokens", "prompt_len"),
                                    ("completion", "completion_tokens", "completion_len")):
            end = (int(self._read(f"samples/{kind}_offset", n - 1, n)[0])
                   + int(self._read(f"samples/{length}", n - 1, n)[0]))
            if end != counts[table]:
                raise CorruptSegmentError(f"{self.path}: {kind} tokens end at {end} but the "
                                          f"commit counts {counts[table]}")

    def _read(self, name: str, a: int, b: int) -> np.ndarray:
        """Rows ``a:b`` of a dataset, checked against its digests when the segment has them."""
        if not self.digested:
            return self.file[self._stored(name)][a:b]
        try:
            out = verified(self.file, self._stored(name), a, b)
            spec = self.layout.get(name)
            if spec is not None and (out.dtype != spec.dtype or out.shape[1:] != spec.trail):
                raise BlockDamage(name, a, b, f"read as {out.dtype}{list(out.shape[1:])}")
            return out
        except BlockDamage as e:
            raise CorruptSegmentError(f"{self.path}: {e}") from e
        except Exception as e:  # HDF5 metadata of the dataset damaged: h5py raises many types
            raise CorruptSegmentError(f"{self.path}: dataset {name} is damaged ({e})") from e

    def verify(self) -> list[str]:
        """Check every block of every dataset against its digest; one sentence per bad block
        (empty when intact). Bad rows per table are kept for `damaged_rows`."""
        if not self.digested:
            self._damaged_rows = {t: np.zeros(self.counts[t], bool) for t in TABLES}
            return []
        bad = {t: np.zeros(self.counts[t], bool) for t in TABLES}
        found = []
        for name, spec in [*self.layout.items(), ("commits", None)]:
            try:
                blocks = damaged_blocks(self.file, self._stored(name))
                ds = self.file[self._stored(name)]
                if spec is not None and (ds.dtype != spec.dtype or ds.shape[1:] != spec.trail):
                    raise ValueError(f"stored as {ds.dtype}{list(ds.shape[1:])}")
            except Exception as e:
                blocks = [BlockDamage(name, 0, self.counts[spec.table] if spec else 1,
                                      f"cannot be read ({e})")]
            for d in blocks:
                found.append(f"{self.path}: {d}")
                if spec is not None:
                    bad[spec.table][d.a:d.b] = True
        try:
            commit = self.file["commits"][-1]
            if [int(v) for v in commit[1:]] != [self.counts[t] for t in TABLES]:
                found.append(f"{self.path}: its commit row disagrees with its datasets' lengths")
        except (OSError, KeyError, ValueError, IndexError) as e:
            found.append(f"{self.path}: commits cannot be read ({e})")
        n = self.counts["samples"]
        for kind, table in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
            if bad[table].any() and n:  # a sample with a bad token is a bad sample
                rows = ~bad["samples"]
                start = self.file[f"samples/{kind}_offset"][:n]
                ln = self.file[f"samples/{kind}_len"][:n].astype(np.int64)
                hit = np.concatenate([[0], np.cumsum(bad[table])])
                lo, hi = np.clip(start, 0, len(bad[table])), np.clip(start + ln, 0, len(bad[table]))
                bad["samples"] |= rows & (hit[hi] - hit[lo] > 0)
        self._damaged_rows = bad
        mapped = isinstance(self.file, MappedFile)
        return found + self.notes + (hdf5_damage(self.path, self.file) if mapped else [])

    def damaged_rows(self) -> dict[str, np.ndarray]:
        """Table -> bool per committed row: True where a block it depends on is damaged."""
        if self._damaged_rows is None:
            self.verify()
        return self._damaged_rows

    @property
    def num_rows(self) -> int:
        return self.counts["samples"]

    def row_tokens(self) -> np.ndarray:
        """Prompt + completion tokens of each row (0 for rows lost to damage)."""
        try:
            return (self.read_column("samples/prompt_len").astype(np.int64)
                    + self.read_column("samples/completion_len"))
        except CorruptSegmentError:
            out = np.zeros(self.num_rows, np.int64)
            good = ~self.damaged_rows()["samples"]
            out[good] = (self.intact_column("samples/prompt_len").astype(np.int64)
                         + self.intact_column("samples/completion_len"))
            return out

    def _stored(self, name: str) -> str:
        """Dataset ``name``'s name in this segment's file (`format.stored_name`; rows in memory
        carry today's names)."""
        return name if isinstance(self.file, ArrayFile) else stored_name(name, self.version)

    # -- reads ---------------------------------------------------------------------------------
    def read_range(self, a: int, b: int) -> SampleBatch:
        """Local rows ``a:b`` as a validated SampleBatch."""
        if not 0 <= a <= b <= self.num_rows:
            raise IndexError(f"{self.path}: rows {a}:{b} outside 0:{self.num_rows}")
        try:
            cols = {name: self._read(f"samples/{name}", a, b) for name in self.schema.scalar_columns()}
            p0 = p1 = c0 = c1 = 0
            if b > a:
                p0 = int(self._read("samples/prompt_offset", a, a + 1)[0])
                c0 = int(self._read("samples/completion_offset", a, a + 1)[0])
                p1 = int(self._read("samples/prompt_offset", b - 1, b)[0]) + int(cols["prompt_len"][-1])
                c1 = (int(self._read("samples/completion_offset", b - 1, b)[0])
                      + int(cols["completion_len"][-1]))
            cols[PROMPT_COLUMN[0]] = self._read(f"samples/{PROMPT_COLUMN[0]}", p0, p1)
            for name in self.schema.prompt_token_fields():
                cols[name] = self._read(f"samples/{name}", p0, p1)
            for name in self.schema.token_fields():
                cols[name] = self._read(f"samples/{name}", c0, c1)
            return SampleBatch(cols, self.schema, validate=True)
        except (OSError, RecordError, ValueError) as e:
            if isinstance(e, CorruptSegmentError):
                raise
            raise CorruptSegmentError(f"{self.path}: rows {a}:{b} are damaged ({e})") from e

    def read_column(self, name: str, a: int = 0, b: int | None = None) -> np.ndarray:
        """Committed values of one dataset, e.g. ``samples/reward`` or ``groups/outcome``."""
        spec = self.layout.get(name)
        if spec is None:
            raise KeyError(f"no dataset {name} in a segment of schema {self.schema}")
        n = self.counts[spec.table]
        b = n if b is None else min(b, n)
        try:
            return self._read(name, a, b)
        except OSError as e:
            raise CorruptSegmentError(f"{self.path}: dataset {name} is damaged ({e})") from e

    def intact_column(self, name: str) -> np.ndarray:
        """Committed values of one dataset without the rows `damaged_rows` marks in its table."""
        spec = self.layout[name]
        bad = self.damaged_rows()[spec.table]
        if not bad.any():
            return self.read_column(name)
        return self.file[self._stored(name)][:self.counts[spec.table]][~bad]

    def read_table(self, table: str, columns) -> dict[str, np.ndarray]:
        return {c: self.read_column(f"{table}/{c}") for c in columns}

    def min_versions(self, block_tokens: int = 1 << 22, intact_only: bool = False) -> np.ndarray:
        """Oldest token version of every committed sample, reading ``versions`` in blocks;
        ``intact_only``: of the samples `damaged_rows` leaves (unchecked reads, bad rows dropped)."""
        if intact_only and self.damaged_rows()["samples"].any():
            bad = self.damaged_rows()["samples"]
            off = self.file["samples/completion_offset"][:self.counts["samples"]][~bad]
            versions = self.file["samples/versions"][:self.counts["completion_tokens"]]
            return versions[off].astype(np.int32)
        off = self.read_column("samples/completion_offset")
        out = np.empty(len(off), dtype=np.int32)
        i = 0
        while i < len(off):
            t0 = int(off[i])
            j = int(np.searchsorted(off, t0 + block_tokens, side="left"))
            j = max(j, i + 1)
            block = self._read("samples/versions", t0, int(off[j - 1]) + 1)
            out[i:j] = block[off[i:j] - t0]
            i = j
        return out

    def close(self) -> None:
        self.file.close()


class _Attrs:
    """A segment's root attributes, where the journal header's ``known`` values win (a damaged
    attribute then does no harm); ``created`` and ``meta`` fall back to defaults if unreadable."""

    def __init__(self, attrs, known: dict):
        self.attrs, self.known = attrs, known

    def __getitem__(self, key: str):
        if key in self.known:
            return self.known[key]
        try:
            return self.attrs[key]
        except Exception:
            if self.known and key in ("created", "meta", "segment_index"):
                return {"created": 0.0, "meta": "{}", "segment_index": -1}[key]
            raise
