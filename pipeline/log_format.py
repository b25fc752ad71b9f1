"""On-disk layout of the rollout log, shared by its writer (`rollout_log`) and readers (`log_reader`).

A run's log is the directory ``RUN/rollouts/`` holding one HDF5 file per writer start,
``segment-00000.h5``, ``segment-00001.h5``, ... (a ``kill -9``'d SWMR writer leaves its file
unopenable for append, so a restart never reopens a segment: it starts the next one). Read in order,
the segments are one log; a sample's *global row* counts across them.

Invariants a segment keeps:

- its root attributes (``tokenflow_schema_version``, ``run_id``, ``record_schema``, ``segment_index``,
  ``first_row``, ``created``, ``meta``) and every dataset exist before the file gets its final name
  (it is built as ``*.tmp`` and linked into place), so a file named ``segment-*.h5`` is never half-built;
- every dataset belongs to one *table* and only grows; its length may exceed the table's count
  (the writer grows datasets geometrically), so readers never trust dataset shapes, only commits;
- ``commits`` holds one row per flush, ``[seq, samples, prompt_tokens, completion_tokens, groups,
  steps, step_meta]`` (seq = row index + 1), written and flushed only after the data it counts was
  flushed. The last valid commit row is what a reader sees, so a flush is atomic for readers and a
  writer killed mid-flush loses nothing that an earlier flush covered;
- ``samples/prompt_offset`` / ``samples/completion_offset`` are each sample's start in the
  segment's flat token datasets. Worked example, one segment holding rows with prompts of 3 and 2
  tokens and completions of 2 and 4: prompt_offset = [0, 3], completion_offset = [0, 2], commit row
  ``[1, 2, 5, 6, 0, 0, 0]``; if the segment's attribute first_row is 10 these are global rows 10, 11.
"""
from __future__ import annotations

import enum
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.record import PROMPT_COLUMN, SCALAR_COLUMNS, RecordSchema

#: Version of this file layout; readers refuse files of a newer version.
SCHEMA_VERSION = 1

SEGMENT_RE = re.compile(r"^segment-(\d{5,})\.h5$")
LOG_DIRNAME = "rollouts"

#: Tables, in the order of a commit row's counts (after its seq column).
TABLES = ("samples", "prompt_tokens", "completion_tokens", "groups", "steps", "step_meta")

#: Filesystems where HDF5 SWMR cannot work (no POSIX write ordering seen by other clients).
SWMR_UNSAFE_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "fuse.sshfs", "9p",
    "ceph", "fuse.ceph", "glusterfs", "fuse.glusterfs"})


class GroupOutcome(enum.IntEnum):
    """How a resolved group ended (``groups/outcome``)."""
    STORED = 0
    FILTERED = 1
    DROPPED_STALE = 2
    DROPPED_INVALID = 3
    EVICTED_STALE = 4
    """Stored earlier, later dropped from the buffer as too stale (a second row for the group)."""


GROUP_COLUMNS = {"group_id": np.dtype(np.int64), "attempt": np.dtype(np.int32),
                 "outcome": np.dtype(np.uint8), "first_row": np.dtype(np.int64),
                 "n_samples": np.dtype(np.int32), "min_version": np.dtype(np.int32),
                 "t": np.dtype(np.float64)}
STEP_COLUMNS = {"step": np.dtype(np.int32), "row": np.dtype(np.int64), "dp_rank": np.dtype(np.int16)}
STEP_META_COLUMNS = {"step": np.dtype(np.int32), "trainer_version": np.dtype(np.int32),
                     "n_samples": np.dtype(np.int32), "n_tokens": np.dtype(np.int64),
                     "t": np.dtype(np.float64)}
OFFSET_COLUMNS = ("prompt_offset", "completion_offset")


class LogError(ValueError):
    """The rollout log cannot be used as asked; the message names the file and the problem."""


class LogNotFoundError(LogError):
    """The path holds no rollout log."""


class NotHDF5Error(LogError):
    """A file is not an HDF5 file at all."""


class ForeignFileError(LogError):
    """An HDF5 file that is not a Tokenflow rollout log."""


class NewerSchemaError(LogError):
    """A segment was written by a newer Tokenflow (layout version above SCHEMA_VERSION)."""


class CorruptSegmentError(LogError):
    """A segment is truncated or damaged."""


class SchemaMismatchError(LogError):
    """Segments (or a writer and the existing log) disagree on run id or record schema."""


class UnsupportedFilesystemError(LogError):
    """The log directory is on a filesystem where SWMR cannot work."""


class LogLockedError(LogError):
    """Another writer holds the log."""


class LogDamageWarning(UserWarning):
    """A damaged segment was skipped (or read partially); the message names it."""


@dataclass(frozen=True)
class DatasetSpec:
    table: str
    """Which table's count gives this dataset's valid length."""
    dtype: np.dtype
    trail: tuple[int, ...]
    """Per-row trailing shape (e.g. (layers, top_k) for routed experts)."""

    @property
    def chunk_rows(self) -> int:
        """Rows per chunk: ~256 KiB for token tables (64k int32 tokens), ~64 KiB otherwise."""
        row_bytes = self.dtype.itemsize * int(np.prod(self.trail, dtype=np.int64))
        target = 256 * 1024 if self.table.endswith("tokens") else 64 * 1024
        return max(16, 1 << int(np.log2(max(1, target // row_bytes))))


def dataset_layout(schema: RecordSchema) -> dict[str, DatasetSpec]:
    """Every dataset of a segment for ``schema``: HDF5 path -> spec (``commits`` excluded)."""
    out = {f"samples/{n}": DatasetSpec("samples", d, ()) for n, d in SCALAR_COLUMNS.items()}
    out.update({f"samples/{n}": DatasetSpec("samples", np.dtype(np.int64), ()) for n in OFFSET_COLUMNS})
    out[f"samples/{PROMPT_COLUMN[0]}"] = DatasetSpec("prompt_tokens", PROMPT_COLUMN[1], ())
    for name, (dtype, trail) in schema.token_fields().items():
        out[f"samples/{name}"] = DatasetSpec("completion_tokens", dtype, trail)
    for table, cols in (("groups", GROUP_COLUMNS), ("steps", STEP_COLUMNS),
                        ("step_meta", STEP_META_COLUMNS)):
        out.update({f"{table}/{n}": DatasetSpec(table, d, ()) for n, d in cols.items()})
    return out


def segment_name(index: int) -> str:
    return f"segment-{index:05d}.h5"


def list_segments(log_dir: Path) -> list[tuple[int, Path]]:
    """(index, path) of every segment file in ``log_dir``, in index order."""
    found = []
    for p in log_dir.iterdir():
        m = SEGMENT_RE.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def resolve_log_path(path: str | os.PathLike) -> tuple[list[Path], str | None]:
    """The segment files a user's path means, and a note when it means more than the path itself.

    Accepts a run directory (reads ``RUN/rollouts/``), a log directory, one segment file (reads
    all its sibling segments: a segment alone is part of a log) or any other single HDF5 file.
    """
    p = Path(path)
    if not p.exists():
        raise LogNotFoundError(f"{p}: no such file or directory")
    if p.is_dir():
        log_dir = p / LOG_DIRNAME if (p / LOG_DIRNAME).is_dir() else p
        segs = list_segments(log_dir)
        if not segs:
            raise LogNotFoundError(f"{p}: no rollout log here (expected {log_dir}/segment-NNNNN.h5)")
        return [s for _, s in segs], None
    if SEGMENT_RE.match(p.name):
        segs = [s for _, s in list_segments(p.parent)]
        note = None if segs == [p] else (
            f"{p.name} is one segment of the log in {p.parent}; reading all {len(segs)} segments")
        return segs, note
    return [p], None


def filesystem_type(path: Path, mounts_text: str | None = None) -> str:
    """Type of the filesystem holding ``path`` (longest mount-point prefix in /proc/mounts)."""
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:
            return "unknown"
    real = os.path.realpath(path)
    best, fstype = "", "unknown"
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].encode().decode("unicode_escape")  # /proc/mounts escapes spaces as \040
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, fstype = mnt, parts[2]
    return fstype


def segment_attrs(schema: RecordSchema, run_id: str, index: int, first_row: int,
                  meta: dict) -> dict:
    """The root attributes of a new segment."""
    return {"tokenflow_schema_version": SCHEMA_VERSION, "run_id": run_id,
            "record_schema": json.dumps(schema.to_dict(), sort_keys=True),
            "segment_index": index, "first_row": first_row, "created": time.time(),
            "meta": json.dumps(meta, sort_keys=True)}


def create_segment_file(path: Path, schema: RecordSchema, attrs: dict) -> None:
    """Build a complete, empty segment at ``path`` (which must not exist), atomically."""
    import h5py
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    with h5py.File(tmp, "w", libver="latest") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        for name, spec in dataset_layout(schema).items():
            f.create_dataset(name, shape=(0, *spec.trail), maxshape=(None, *spec.trail),
                             dtype=spec.dtype, chunks=(spec.chunk_rows, *spec.trail))
        f.create_dataset("commits", shape=(0, 1 + len(TABLES)), maxshape=(None, 1 + len(TABLES)),
                         dtype=np.int64, chunks=(256, 1 + len(TABLES)))
    try:
        os.link(tmp, path)  # fails if the name exists: two writers cannot take one index
    finally:
        tmp.unlink()
