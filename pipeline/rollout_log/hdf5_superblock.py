"""What a segment file's HDF5 superblock says, read without HDF5 (which may hang or crash on a
file cut short): where the file should end and whether a writer still had it open.

Invariants: read-only, a few hundred bytes from the file's start; a sealed segment's superblock
follows its user block (512, 1024, 2048, ... bytes: the segment's map, `segment_map`); a file with
no superblock found gives "unknown" (None, 0, False), never an error.

Worked example: a sealed segment with a 4 KiB user block whose superblock (version 2, 8-byte
offsets) records an end of 40,960 bytes but which holds 32,768 bytes has a `shortfall` of 8,192:
it was cut, and is refused as truncated before HDF5 opens it.
"""
from __future__ import annotations

import os
from pathlib import Path

_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _superblock(path: Path) -> tuple[int, bytes] | None:
    """(file offset, first 64 bytes) of the HDF5 superblock: at 0, or after a user block (512,
    1024, 2048, ... bytes; sealed segments keep their map there); None if not found."""
    with open(path, "rb") as fh:
        for at in [0] + [512 << k for k in range(12)]:
            fh.seek(at)
            head = fh.read(64)
            if head[:8] == _SIGNATURE:
                return at, head
            if len(head) < 64:
                return None
    return None


def _superblock_eof(path: Path) -> int | None:
    """End of the file as its HDF5 superblock records it (None if unknown)."""
    found = _superblock(path)
    if found is None:
        return None
    head = found[1]
    version = head[8]
    size_of_offsets = head[13] if version < 2 else head[9]
    at = {0: 24, 1: 28}.get(version, 12) + 2 * size_of_offsets
    if size_of_offsets not in (4, 8) or at + size_of_offsets > len(head):
        return None
    return int.from_bytes(head[at:at + size_of_offsets], "little")  # (counts the user block)


def marked_open_for_write(path: Path) -> bool:
    """Whether the superblock (version >= 2) says a writer still has the file open: a layout-1
    SWMR segment whose writer was killed. Sealed segments are closed before they are named."""
    found = _superblock(path)
    head = found[1] if found else b""
    return len(head) >= 12 and head[8] >= 2 and bool(head[11] & 0x05)


def shortfall(path: Path) -> int:
    """Bytes missing between the file's size and the end its superblock records (0 if none)."""
    eof = _superblock_eof(path)
    return max(0, eof - os.path.getsize(path)) if eof is not None else 0
