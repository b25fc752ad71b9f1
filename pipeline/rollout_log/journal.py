"""The rollout log's journal files: append-only, one entry per flush, each entry checksummed.

A journal file ``LOG_DIR/journal-GGGGGGGG.tfj`` belongs to one *generation* ``G`` of the log; a
generation is claimed by creating its file exclusively (``O_EXCL``: two writers can never own the
same generation, on a local disk or on NFS, Lustre, GPFS or sshfs). An entry on disk is::

    b"TFJ1" | n (uint32 LE) | n frame lengths (uint64 LE) | frame 0 | ... | frame n-1

and its frames are one `pipeline.protocol.wire` message (msgpack header + raw array frames) whose GMAC,
computed with the fixed public key `JOURNAL_KEY`, serves as a 128-bit checksum of the lengths,
header and arrays (here it detects torn and damaged writes; it authenticates nothing).

Invariants:

- the first entry of a journal is its header (kind ``journal``: generation, writer id, the sealed
  segments the log holds, the next sequence number and row); later entries are flushes (kind
  ``flush``, meta ``seq`` = header's ``start_seq``, +1, +2, ...) holding the new rows of every
  dataset of the log layout;
- `append` returns only after ``fdatasync``: an entry it wrote survives ``kill -9`` of the writer
  and a crash of its node; a failed append (disk full) truncates the file back to its previous end,
  so the entry can be retried and nothing after a torn entry is ever written;
- `read_entries` returns the *valid prefix*: entries up to (not including) the first one that is cut
  short, fails its checksum or breaks the sequence.

Worked example: a journal with header (start_seq 41) and entries seq 41, 42, 43 where the writer was
killed while writing 43 reads as [header, 41, 42]; ``valid_end`` is the offset where 43 starts.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from pipeline.protocol import wire

JOURNAL_RE = re.compile(r"^journal-(\d{8,})\.tfj$")
MAGIC = b"TFJ1"
#: Fixed, public: the GMAC under this key is a checksum, not an authenticator.
JOURNAL_KEY = hashlib.sha256(b"tokenflow rollout log journal checksum v1").digest()
_MAX_ENTRY_BYTES = 1 << 40


def journal_name(gen: int) -> str:
    return f"journal-{gen:08d}.tfj"


def list_journals(log_dir: Path) -> list[tuple[int, Path]]:
    """(generation, path) of every journal file in ``log_dir``, oldest first."""
    found = []
    for name in os.listdir(log_dir):
        m = JOURNAL_RE.match(name)
        if m:
            found.append((int(m.group(1)), log_dir / name))
    return sorted(found)


def encode_entry(kind: str, meta: Mapping[str, Any],
                 arrays: Mapping[str, np.ndarray] | None = None) -> list[bytes | memoryview]:
    """The byte parts of one entry (written with one ``writev``; arrays are not copied)."""
    frames = wire.encode(JOURNAL_KEY, kind, meta, arrays)
    lens = [memoryview(f).nbytes for f in frames]
    return [MAGIC + struct.pack(f"<I{len(lens)}Q", len(lens), *lens), *frames]


@dataclass
class JournalRead:
    entries: list[wire.Message]
    """Valid entries, header first (empty if even the header is torn)."""
    valid_end: int
    """Byte offset where the valid prefix ends."""
    size: int
    """Bytes in the file when read."""
    cut: str | None
    """Why reading stopped before ``size`` (None when the whole file is valid)."""


def read_entries(data: bytes | memoryview, first_seq: int | None = None) -> JournalRead:
    """Parse a journal file's bytes into its valid prefix (see module invariants). Entry arrays
    are read-only views of ``data``. ``first_seq`` (default: the header's ``start_seq``) is the
    sequence number the first flush entry must carry."""
    view = memoryview(data)
    out: list[wire.Message] = []
    pos, size = 0, view.nbytes
    while pos < size:
        if size - pos < 8:
            return JournalRead(out, pos, size, f"entry at byte {pos} is cut short")
        if bytes(view[pos:pos + 4]) != MAGIC:
            return JournalRead(out, pos, size, f"no entry marker at byte {pos}")
        (n,) = struct.unpack_from("<I", view, pos + 4)
        if not 2 <= n <= wire.MAX_FRAMES + 2:
            return JournalRead(out, pos, size, f"entry at byte {pos} declares {n} frames")
        body = pos + 8 + 8 * n
        if body > size:
            return JournalRead(out, pos, size, f"entry at byte {pos} is cut short")
        lens = struct.unpack_from(f"<{n}Q", view, pos + 8)
        end = body + sum(lens)
        if end > size:
            return JournalRead(out, pos, size, f"entry at byte {pos} is cut short")
        frames, at = [], body
        for ln in lens:
            frames.append(view[at:at + ln])
            at += ln
        try:
            msg = wire.decode(JOURNAL_KEY, frames, _MAX_ENTRY_BYTES)
        except wire.FrameError as e:
            return JournalRead(out, pos, size, f"entry at byte {pos} fails its checksum ({e})")
        if not out:
            if msg.kind != "journal":
                return JournalRead(out, pos, size, "the first entry is not a journal header")
            expect = int(msg.meta["start_seq"]) if first_seq is None else first_seq
        elif msg.kind != "flush" or msg.meta.get("seq") != expect:
            return JournalRead(out, pos, size, f"entry at byte {pos} is {msg.kind} "
                               f"seq {msg.meta.get('seq')}, expected flush seq {expect}")
        else:
            expect += 1
        out.append(msg)
        pos = end
    return JournalRead(out, pos, size, None)


def read_journal(path: Path) -> JournalRead:
    """Read a whole journal file (one ``read``: its size is bounded by the seal cadence)."""
    with open(path, "rb") as fh:
        data = fh.read()
    return read_entries(data)


class JournalFile:
    """The writer's handle on the journal generation it claimed."""

    def __init__(self, path: Path):
        """Claim ``path`` exclusively; raises FileExistsError if another writer has it."""
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.end = 0

    def append(self, parts: list) -> None:
        """Write one entry and ``fdatasync`` it (see module invariants)."""
        total = sum(memoryview(p).nbytes for p in parts)
        try:
            done = os.writev(self.fd, parts)
            while done < total:  # a short write: write the rest
                rest, skip = [], done
                for p in parts:
                    m = memoryview(p).cast("B")
                    if skip >= m.nbytes:
                        skip -= m.nbytes
                        continue
                    rest.append(m[skip:])
                    skip = 0
                parts, total, done = rest, total - done, os.writev(self.fd, rest)
            os.fdatasync(self.fd)
        except OSError:
            os.ftruncate(self.fd, self.end)
            os.lseek(self.fd, self.end, os.SEEK_SET)
            raise
        self.end = os.lseek(self.fd, 0, os.SEEK_CUR)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def fsync_dir(path: Path) -> None:
    """Make entries created, renamed or removed in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS):
            raise  # some filesystems (FUSE) cannot sync a directory: their namespace is synchronous
    finally:
        os.close(fd)
