"""The log's files leave the page cache once durable (`pipeline.rollout_log.journal.drop_cached`):
every 4 MiB of journal entries after their ``fdatasync``, a sealed segment's data every `SEAL_SYNC_BYTES` and at its
end. Residency is read with ``mincore(2)`` over a mapping of the file; the reference is a file
written and synced the same way without the hint, whose pages stay cached."""
from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np

from pipeline.protocol.record import RecordSchema
from pipeline.rollout_log.format import filesystem_type
from pipeline.rollout_log.journal import JournalFile
from pipeline.rollout_log.writer import RolloutLogWriter
from support.rollout_data import make_batch

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
IGNORE_THE_HINT = {"tmpfs", "ramfs"}  # memory filesystems: their pages are the file, they stay


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache now (whole pages)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        pages = -(-size // mmap.PAGESIZE)
        vec = ctypes.create_string_buffer(pages)
        assert LIBC.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        LIBC.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) * mmap.PAGESIZE


def test_journal_entries_and_sealed_segments_leave_the_page_cache(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
    reference = tmp_path / "reference"
    fd = os.open(reference, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, data)
    os.fdatasync(fd)
    os.close(fd)
    journal = JournalFile(tmp_path / "journal-00000001.tfj")
    journal.append([data[: 4 << 20], data[4 << 20:]])
    journal.close()
    log_dir = tmp_path / "rollouts"
    with RolloutLogWriter(log_dir, RecordSchema(), "r", {}) as w:
        for k in range(4):  # ~2.4 MB of tokens a flush
            w.append_samples(make_batch(RecordSchema(), k, 40, first_group=10 * k, completion_len=(5000, 5000)))
            w.flush()
    (segment,) = log_dir.glob("*.h5")
    assert reference.stat().st_size == journal.path.stat().st_size == 8 << 20
    assert segment.stat().st_size > 8 << 20
    if filesystem_type(tmp_path) in IGNORE_THE_HINT:
        assert resident_bytes(journal.path) == journal.path.stat().st_size
        return
    assert resident_bytes(reference) == 8 << 20  # written and synced, still cached
    assert resident_bytes(journal.path) == 0
    # what stays is what the writer reads back as it opens the sealed segment (its map, HDF5's
    # metadata, small datasets), not the token data it wrote
    assert resident_bytes(segment) < segment.stat().st_size // 10
