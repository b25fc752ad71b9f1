"""On-disk layout of the rollout log, shared by its writer (`rollout_log`) and readers (`log_reader`).

A run's log is the directory ``RUN/rollouts/`` holding immutable HDF5 *segments*
``segment-NNNNN.h5`` and the current generation's append-only *journal* ``journal-GGGGGGGG.tfj``
(format in `log_journal`). A writer acknowledges a flush once its journal entry is ``fdatasync``'d;
every ``seal_interval_s`` it seals what the journal holds into a new segment and starts the next
generation. Read in order, the sealed segments and then the journal's valid entries are one log;
a sample's *global row* counts across them. (Layout version 1, written before the journal existed,
is a directory of segments only; it is still read.)

Invariants a segment keeps:

- it is complete before it gets its name: written as a ``*.tmp`` file, fsync'd, renamed, the
  directory fsync'd; it is never modified afterwards. Its name carries the journal generation that
  sealed it, which its writer claimed exclusively, so no two writers ever write the same name;
- its root attributes: ``tokenflow_schema_version``, ``run_id``, ``record_schema``,
  ``segment_index`` (= its name's number), ``first_row``, ``first_seq``/``last_seq`` (the journal
  sequence numbers it holds; 0/0 for none), ``writer``, ``created``, ``meta``;
- every dataset belongs to one *table*; ``commits`` holds ``[seq, samples, prompt_tokens,
  completion_tokens, groups, steps, step_meta]`` rows whose last valid row gives the tables' counts
  (a sealed segment has exactly one; layout-1 segments had one per flush);
- ``samples/prompt_offset`` / ``samples/completion_offset`` are each sample's start in the
  segment's flat token datasets. Worked example, one segment holding rows with prompts of 3 and 2
  tokens and completions of 2 and 4: prompt_offset = [0, 3], completion_offset = [0, 2], commit row
  ``[1, 2, 5, 6, 0, 0, 0]``; if the segment's attribute first_row is 10 these are global rows 10, 11.

Which segments belong to the log is said by the newest journal with a valid header (see
`log_scan`); a segment no header lists (left by a writer that stopped before publishing it, or by a
fenced stale writer) is ignored and reported.
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

#: Version of this file layout; readers refuse files of a newer version (and read version 1).
SCHEMA_VERSION = 2

SEGMENT_RE = re.compile(r"^segment-(\d{5,})\.h5$")
LOG_DIRNAME = "rollouts"

#: Tables, in the order of a commit row's counts (after its seq column).
TABLES = ("samples", "prompt_tokens", "completion_tokens", "groups", "steps", "step_meta")

#: Filesystems refused outright: object-store mounts whose fsync does not make a write durable
#: where other nodes read it (a file is uploaded when it is closed, if at all).
REFUSED_FILESYSTEMS = {
    "fuse.s3fs": "an S3 object-store mount (s3fs)", "fuse.goofys": "an object-store mount (goofys)",
    "fuse.gcsfuse": "a Google Cloud Storage mount (gcsfuse)", "fuse.rclone": "an rclone mount",
    "fuse.mountpoint-s3": "an S3 object-store mount (mountpoint-s3)",
    "fuse.blobfuse2": "an Azure Blob mount (blobfuse2)"}


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
    """The log directory's filesystem cannot make a write durable (the message says why)."""


class LogFencedError(LogError):
    """A newer writer took over the log: this (stale) writer may not write to it any more."""


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


def resolve_log_path(path: str | os.PathLike) -> tuple[Path, str | None]:
    """The log directory (or single HDF5 file) a user's path means, and a note when it means more
    than the path itself.

    Accepts a run directory (reads ``RUN/rollouts/``), a log directory, one segment file (reads
    its whole log: a segment alone is part of a log) or any other single HDF5 file.
    """
    p = Path(path)
    if not p.exists():
        raise LogNotFoundError(f"{p}: no such file or directory")
    if p.is_dir():
        log_dir = p / LOG_DIRNAME if (p / LOG_DIRNAME).is_dir() else p
        if not any(SEGMENT_RE.match(n) or n.endswith(".tfj") for n in os.listdir(log_dir)):
            raise LogNotFoundError(f"{p}: no rollout log here (expected {log_dir}/segment-NNNNN.h5 "
                                   "or journal-GGGGGGGG.tfj)")
        return log_dir, None
    if SEGMENT_RE.match(p.name):
        return p.parent, f"{p.name} is one segment of the log in {p.parent}; reading the whole log"
    return p, None


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


def segment_attrs(schema: RecordSchema, run_id: str, index: int, first_row: int, meta: dict,
                  first_seq: int = 0, last_seq: int = 0, writer: str = "") -> dict:
    """The root attributes of a new segment."""
    return {"tokenflow_schema_version": SCHEMA_VERSION, "run_id": run_id,
            "record_schema": json.dumps(schema.to_dict(), sort_keys=True),
            "segment_index": index, "first_row": first_row, "first_seq": first_seq,
            "last_seq": last_seq, "writer": writer, "created": time.time(),
            "meta": json.dumps(meta, sort_keys=True)}


def write_sealed_segment(path: Path, schema: RecordSchema, attrs: dict,
                         data: dict[str, np.ndarray], counts: dict[str, int]) -> None:
    """Write an immutable segment holding ``data[name][:rows of its table]`` for every dataset
    of the layout: aside as ``*.tmp``, fsync'd, renamed to ``path``, the directory fsync'd."""
    import h5py

    from pipeline.log_journal import fsync_dir
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with h5py.File(tmp, "w", libver="latest") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        for name, spec in dataset_layout(schema).items():
            f.create_dataset(name, data=data[name][:counts[spec.table]])
        f.create_dataset("commits", data=np.array([[1, *(counts[t] for t in TABLES)]], np.int64))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(path.parent)


def check_log_filesystem(log_dir: Path, mounts_text: str | None = None) -> str:
    """Refuse (`UnsupportedFilesystemError`, naming the reason) a directory where the log cannot
    be durable; returns its filesystem type. Probes what the log relies on: exclusive create,
    write + ``fdatasync``/``fsync``, rename, directory fsync, remove."""
    from pipeline.log_journal import fsync_dir
    fstype = filesystem_type(log_dir, mounts_text)
    if fstype in REFUSED_FILESYSTEMS:
        raise UnsupportedFilesystemError(
            f"{log_dir} is on {REFUSED_FILESYSTEMS[fstype]} ({fstype}), whose fsync does not make "
            "a write durable for other nodes; put the run directory on a local disk, NFS, Lustre "
            "or GPFS (see docs/rollout-log.md)")
    probe = log_dir / f".probe-{os.getpid()}-{time.monotonic_ns()}"
    step = "create a file"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            step = "write + fdatasync"
            os.write(fd, b"tokenflow durability probe")
            os.fdatasync(fd)
            step = "fsync"
            os.fsync(fd)
        finally:
            os.close(fd)
        step = "refuse a second exclusive create"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            raise OSError("O_EXCL is not honoured: two writers could claim one journal")
        step = "rename"
        os.rename(probe, probe.with_suffix(".renamed"))
        probe = probe.with_suffix(".renamed")
        step = "fsync the directory"
        fsync_dir(log_dir)
        step = "remove a file"
        os.unlink(probe)
    except OSError as e:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
        raise UnsupportedFilesystemError(
            f"{log_dir} ({fstype}) cannot hold the rollout log: {step} failed ({e}); the log "
            "acknowledges results only once they are durable (see docs/rollout-log.md)") from e
    return fstype
