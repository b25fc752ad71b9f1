"""The rollout log's journal files: append-only, one entry per flush, each entry checksummed.

A journal file ``LOG_DIR/journal-GGGGGGGG.tfj`` belongs to one *generation* ``G`` of the log; a
generation is claimed by creating its file exclusively (``O_EXCL``: two writers can never own the
same generation, on a local disk or on NFS, Lustre, GPFS or sshfs). An entry on disk is::

    b"TFJ2" | n (uint32 LE) | n frame lengths (uint64 LE) | crc32 of the above (uint32 LE)
    | frame 0 | ... | frame n-1

and its frames are one `pipeline.protocol.wire` message (msgpack header + raw array frames) whose GMAC,
computed with the fixed public key `JOURNAL_KEY`, serves as a 128-bit checksum of the header and
arrays (here it detects torn and damaged writes; it authenticates nothing). The crc32 makes the
lengths trustworthy on their own, so a reader can skip a damaged entry and resynchronise on the
next ``TFJ2`` marker whose lengths and payload check out. Journals written before (``TFJ1``: no
length checksum) are still read, up to their first bad entry.

Invariants:

- entries are typed records (`pipeline.protocol.journal_entries`): one whose fields do not decode
  is a bad entry like one that fails its checksum;
- the first entry of a journal is its header (`JournalHeader`: generation, writer id, the sealed
  segments and carried journals the log holds, the next sequence number and row, what damage has
  cost so far), written twice (entry 1 is its copy, so one damaged header loses nothing); later
  entries are flushes (`FlushEntry`, ``seq`` = header's ``start_seq``, +1, +2, ...) holding
  the new rows of every dataset of the log layout and where they start (``row``, ``prompt_at``,
  ``completion_at``: the first global row and the generation's token offsets; ``steps_at``: the step
  records before them in this generation);
- `append` returns only after ``fdatasync``: an entry it wrote survives ``kill -9`` of the writer
  and a crash of its node (its pages then leave the page cache, `DROP_EVERY_BYTES` at a time); a
  failed append (disk full) truncates the file back to its previous end, so the entry can be
  retried and nothing after a torn entry is ever written;
- `read_entries` returns the valid entries: a bad entry (damaged marker, lengths or payload, or a
  sequence number out of order) followed by valid entries is *damage* (``damage``, the missing
  sequence numbers counted in ``lost_seqs``): reading goes on at the next valid entry; a bad entry
  with nothing valid after it is a *torn tail* (``cut``; a write in progress or a killed writer)
  when the file ends inside it or only zeros follow (a node crash's unwritten blocks), else a
  *damaged tail* (``damaged_tail``: a whole entry was there, it may have been acknowledged).

Worked example: a journal with header (start_seq 41) and entries seq 41, 42, 43 where the writer was
killed while writing 43 reads as [header, 41, 42]; ``valid_end`` is the offset where 43 starts. Had
a bit flipped in entry 42 instead, it reads as [header, 41, 43], ``damage`` names 42's bytes and
``lost_seqs`` is 1.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.protocol import codec, wire
from pipeline.protocol.journal_entries import JOURNAL, FlushEntry, JournalHeader

Entry = JournalHeader | FlushEntry

JOURNAL_RE = re.compile(r"^journal-(\d{8,})\.tfj$")
MAGIC = b"TFJ2"
MAGIC_V1 = b"TFJ1"
"""Entries of journals written before entries had a length checksum (read, never written)."""
#: A header's copy must start within this many bytes of the file's start.
_HEADER_AREA = 1 << 20
#: Fixed, public: the GMAC under this key is a checksum, not an authenticator.
JOURNAL_KEY = hashlib.sha256(b"tokenflow rollout log journal checksum v1").digest()
_MAX_ENTRY_BYTES = 1 << 40
DROP_EVERY_BYTES = 4 << 20
"""The journal's synced pages leave the page cache (`drop_cached`) once this many bytes were written
since the last time: one call per ~4 MiB, not one per flush on the acknowledgement's path."""
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
"""Most buffers one ``writev`` takes (an entry of more parts is written in several calls)."""


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


def encode_entry(entry: Entry) -> list[bytes | memoryview]:
    """The byte parts of one entry (written with ``writev``; arrays are not copied, and an array
    given as `wire.Pieces` is written from its pieces: a frame may be several parts)."""
    frames = wire.encode_frames(JOURNAL_KEY, *codec.encode(entry))  # buffers of bytes ('B')
    lens = [sum(map(len, f)) if type(f) is list else len(f) for f in frames]
    prefix = MAGIC + struct.pack(f"<I{len(lens)}Q", len(lens), *lens)
    parts = [prefix + struct.pack("<I", zlib.crc32(prefix))]
    for f in frames:
        parts += f if type(f) is list else (f,)
    return parts


@dataclass
class JournalRead:
    entries: list[Entry]
    """Valid entries, header first (empty if even the header is torn); the header's copy left out."""
    valid_end: int
    """Byte offset where the valid entries end."""
    size: int
    """Bytes in the file when read."""
    cut: str | None
    """Why reading stopped before ``size`` (None when the whole file is valid): a torn tail."""
    damage: list[str] = field(default_factory=list)
    """Damaged byte ranges followed by valid entries (kept), one sentence each."""
    lost_seqs: int = 0
    """Flush entries missing between valid ones (their sequence numbers are skipped)."""
    damaged_tail: bool = False
    """The bytes after the last valid entry are damage, not a torn write: an entry that was
    whole on disk (so maybe acknowledged, holding anything) is lost."""


def _entry_at(view: memoryview, pos: int) -> tuple[str, Entry | None, int, str]:
    """Parse the entry at ``pos``: ("ok", message, end, ""), ("cut", None, -1, why) when it runs
    past the end of the file, or ("bad", None, end or -1, why)."""
    size = view.nbytes
    if size - pos < 8:
        return "cut", None, -1, f"entry at byte {pos} is cut short"
    magic = bytes(view[pos:pos + 4])
    if magic not in (MAGIC, MAGIC_V1):
        return "bad", None, -1, f"no entry marker at byte {pos}"
    (n,) = struct.unpack_from("<I", view, pos + 4)
    if not 2 <= n <= wire.MAX_FRAMES + 2:
        return "bad", None, -1, f"entry at byte {pos} declares {n} frames"
    body = pos + 8 + 8 * n + (4 if magic == MAGIC else 0)
    if body > size:
        return "cut", None, -1, f"entry at byte {pos} is cut short"
    if magic == MAGIC:
        (crc,) = struct.unpack_from("<I", view, body - 4)
        if zlib.crc32(view[pos:body - 4]) != crc:
            return "bad", None, -1, f"entry at byte {pos} fails its length checksum"
    lens = struct.unpack_from(f"<{n}Q", view, pos + 8)
    end = body + sum(lens)
    if end > size:
        return "cut", None, -1, f"entry at byte {pos} is cut short"
    frames, at = [], body
    for ln in lens:
        frames.append(view[at:at + ln])
        at += ln
    try:
        msg = wire.decode(JOURNAL_KEY, frames, _MAX_ENTRY_BYTES)
    except wire.FrameError as e:
        return "bad", None, end, f"entry at byte {pos} fails its checksum ({e})"
    try:
        return "ok", JOURNAL.decode(msg), end, ""
    except codec.MessageError as e:
        return "bad", None, end, f"entry at byte {pos} is not a journal entry ({e})"


def read_entries(data: bytes | memoryview, first_seq: int | None = None) -> JournalRead:
    """Parse a journal file's bytes into its valid entries (see module invariants). Entry arrays
    are read-only views of ``data``. ``first_seq`` (default: the header's ``start_seq``) is the
    sequence number the first flush entry must carry."""
    view = memoryview(data)
    raw = data if isinstance(data, (bytes, bytearray)) else bytes(view)
    out: list[Entry] = []
    pos, size, damage, lost, expect, resynced = 0, view.nbytes, [], 0, first_seq, False
    resync = raw[:4] == MAGIC  # layout-1 journals (TFJ1) are read up to their first bad entry
    while pos < size:
        state, msg, end, why = _entry_at(view, pos)
        if state == "ok":
            if isinstance(msg, JournalHeader):
                if out:  # the header's copy (entry 1), or a header where a flush belongs
                    if len(out) == 1 and end <= _HEADER_AREA:
                        pos = end
                        continue
                    state, why = "bad", f"entry at byte {pos} is a second journal header"
                else:
                    expect = msg.start_seq if expect is None else expect
            elif not out:
                state, why = "bad", f"entry at byte {pos} is {msg.KIND}, not the journal header"
            elif msg.seq != expect and not (resynced and msg.seq > expect):
                state, why = "bad", f"entry at byte {pos} is flush seq {msg.seq}, expected flush seq {expect}"
            else:
                lost += msg.seq - expect
                expect = msg.seq + 1
        if state == "ok":
            out.append(msg)
            pos, resynced = end, False
            continue
        nxt = _next_valid(raw, view, pos + 1, expect, bool(out)) if resync else None
        if nxt is None:
            if not resync or state == "cut" or not any(raw[pos:]):  # killed mid-write, or a
                return JournalRead(out, pos, size, why, damage, lost)  # crash's zero-filled end
            damage.append(f"bytes {pos}..{size} (the end) damaged ({why}): a whole entry that "
                          "fails its checks, not a torn write")
            return JournalRead(out, pos, size, None, damage, lost, damaged_tail=True)
        damage.append(f"bytes {pos}..{nxt} damaged ({why}); the entries after them are kept")
        pos, resynced = nxt, True
    return JournalRead(out, pos, size, None, damage, lost)


def _next_valid(raw: bytes, view: memoryview, start: int, expect: int | None,
                have_header: bool) -> int | None:
    """Offset of the next whole, valid entry at or after ``start`` that may follow (a flush
    beyond ``expect`` once a header was read, else a header): where reading resynchronises."""
    at = raw.find(MAGIC, start)
    while at >= 0:
        state, msg, _, _ = _entry_at(view, at)
        if state == "ok" and ((isinstance(msg, JournalHeader) and not have_header) or (
                have_header and isinstance(msg, FlushEntry) and msg.seq >= expect)):
            return at
        at = raw.find(MAGIC, at + 1)
    return None


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
        self.end = self.dropped = 0  # bytes written; of them, given back to the kernel (`drop_cached`)

    def append(self, parts: list) -> None:
        """Write one entry (`write_all`) and ``fdatasync`` it (see module invariants)."""
        try:
            write_all(self.fd, parts)
            os.fdatasync(self.fd)
        except OSError:
            os.ftruncate(self.fd, self.end)
            os.lseek(self.fd, self.end, os.SEEK_SET)
            raise
        self.end = os.lseek(self.fd, 0, os.SEEK_CUR)
        if self.end - self.dropped >= DROP_EVERY_BYTES:  # synced: its pages can go
            drop_cached(self.fd, self.dropped, self.end - self.dropped)
            self.dropped = self.end

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def write_all(fd: int, parts: list, offset: int | None = None) -> int:
    """Write every byte of ``parts`` (C-contiguous buffers: bytes, arrays, memoryviews) to ``fd``,
    from their own memory: at the file position (``writev``) or, given ``offset``, at that offset
    (``pwritev``); at most `IOV_MAX` buffers a call, a short write followed by the rest, a call that
    writes nothing an ``OSError`` (EIO: it would never finish). Returns the bytes written. The
    journal's entries and a seal's datasets are written with it."""
    bufs = [b for b in (memoryview(p).cast("B") for p in parts) if b.nbytes]
    written = 0
    while bufs:
        batch = bufs[:IOV_MAX]
        done = os.writev(fd, batch) if offset is None else os.pwritev(fd, batch, offset + written)
        if done <= 0:
            raise OSError(errno.EIO, f"{'writev' if offset is None else 'pwritev'} wrote nothing")
        written += done
        k = 0
        while k < len(batch) and done >= batch[k].nbytes:
            done -= batch[k].nbytes
            k += 1
        bufs = bufs[k:]
        if done:
            bufs[0] = bufs[0][done:]
    return written


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Give the page cache of a durable (synced) byte range of ``fd`` back to the kernel (``length``
    0: to the end of the file). The log's files are written once and read back only by a restart
    or another process, so keeping their pages costs memory and, for each newly written page, a
    fresh page: recycled pages are ~8x cheaper to write into than fresh ones (a first-touch fault
    of a page the hypervisor had reclaimed, bench/results/2026-12-06-ingest.md, Session 6). A hint:
    where the filesystem ignores it, the pages stay cached."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


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


def copy_aside(src: Path) -> Path:
    """Copy journal ``src`` durably to ``src.damaged`` (written aside as a hidden ``*.tmp``,
    fsync'd, renamed, the directory fsync'd); returns the copy's path. A failure (disk full)
    leaves no ``*.tmp`` behind and raises the OSError."""
    dst = src.with_name(src.name + ".damaged")
    tmp = src.with_name(f".{dst.name}.{os.getpid()}.tmp")
    with open(src, "rb") as fh:
        data = fh.read()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view.nbytes:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, dst)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dst.parent)
    return dst
