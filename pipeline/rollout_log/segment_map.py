"""A sealed segment's map: where each dataset's bytes lie, so rows stay readable when HDF5's own
metadata (superblock, object headers, B-trees) is damaged.

A sealed segment's datasets are contiguous, so each is one byte range of the file. When it seals a
segment, the writer records every dataset's (and every digest dataset's) file offset, dtype and
shape in the HDF5 *user block* (bytes HDF5 reserves at the file's start and never reads)::

    b"TFSM" | n (uint32 LE) | n bytes of JSON {name: [offset, dtype, shape(, rows)]} | crc32 (uint32 LE)

Invariants:

- the map is written after HDF5 closed the file and before it is fsync'd and renamed: a sealed
  segment (layout >= 3) always has one; a damaged map (crc32 mismatch) is never used;
- `MappedFile` offers what `digests` reads from an open HDF5 file (``f[name]`` with ``shape``
  and slicing; ``f["digests/..."]`` with ``attrs["rows"]``), read from those byte ranges: rows read
  through it are checked against their digests like any other read.

Worked example: ``samples/reward`` (float32, 48 rows) at offset 12,288 is ``[12288, "<f4", [48]]``;
reading rows 8:16 reads bytes 12,320-12,351.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np

MAGIC = b"TFSM"


def userblock_size(n_datasets: int) -> int:
    """User block bytes for a map of ``n_datasets`` entries (HDF5: a power of two >= 512)."""
    need = 64 + 160 * n_datasets
    return max(512, 1 << (need - 1).bit_length())


def describe(f) -> dict:
    """The map of an open HDF5 file written contiguously: every dataset's place."""
    out = {}

    def visit(name, obj):
        if hasattr(obj, "id") and hasattr(obj.id, "get_offset"):
            out[name] = place(obj, int(obj.attrs["rows"]) if "rows" in obj.attrs else None)
    f.visititems(visit)
    return out


def place(ds, rows: int | None = None) -> list:
    """Dataset ``ds``'s map entry: [offset (-1: no storage), dtype, shape(, digest block rows)]."""
    offset = ds.id.get_offset()
    entry = [int(offset) if offset is not None else -1, ds.dtype.str, list(ds.shape)]
    return entry + [rows] if rows is not None else entry


def write_map(path: Path, entries: dict, size: int) -> None:
    """Write the map into the first ``size`` bytes (the user block) of closed file ``path``."""
    body = json.dumps(entries, separators=(",", ":")).encode()
    blob = MAGIC + struct.pack("<I", len(body)) + body
    blob += struct.pack("<I", zlib.crc32(blob))
    if len(blob) > size:
        raise ValueError(f"segment map of {len(blob)} bytes exceeds the user block ({size})")
    with open(path, "r+b") as fh:
        fh.write(blob)


class _Digests(np.ndarray):
    """A digest dataset read through the map (``attrs["rows"]`` as in the HDF5 file)."""
    attrs: dict


class MappedFile:
    """A sealed segment's datasets read through its map (see module invariants)."""

    def __init__(self, path: Path):
        """Raises ValueError when the file has no intact map."""
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8 or head[:4] != MAGIC:
                raise ValueError("no segment map")
            (n,) = struct.unpack("<I", head[4:])
            rest = fh.read(n + 4)
        if len(rest) != n + 4 or zlib.crc32(head + rest[:n]) != struct.unpack("<I", rest[n:])[0]:
            raise ValueError("the segment map fails its checksum")
        self.entries = json.loads(rest[:n])
        self.attrs: dict = {}
        self._data = np.memmap(self.path, np.uint8, "r")

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.entries:
            raise KeyError(f"no dataset {name} in the segment map")
        offset, dtype, shape, *rows = self.entries[name]
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if offset < 0 or offset + count * dtype.itemsize > len(self._data):
            raise ValueError(f"{name}: its bytes lie outside the file")
        arr = self._data[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)
        if rows:
            arr = arr.view(_Digests)
            arr.attrs = {"rows": rows[0]}
        return arr

    def close(self) -> None:
        self._data = None


def hdf5_damage(path: Path, mapped: MappedFile) -> list[str]:
    """Whether HDF5 still reads the file as its map says (metadata only: opening, and every
    dataset's place, dtype and shape); one sentence if not (Tokenflow reads through the map, but
    h5py and h5dump would fail or mislead)."""
    import h5py
    try:
        with h5py.File(path, "r") as f:
            found = describe(f)
    except Exception as e:
        return [f"{path}: HDF5 cannot open it ({type(e).__name__}: {e}); its rows are read through "
                "the segment map (h5py and h5dump fail on it)"]
    if found != mapped.entries:
        bad = sorted(k for k in set(found) | set(mapped.entries) if found.get(k) != mapped.entries.get(k))
        return [f"{path}: HDF5 metadata damaged ({', '.join(bad[:3])} disagree with the segment "
                "map); its rows are read through the map (h5py and h5dump may misread it)"]
    return []
