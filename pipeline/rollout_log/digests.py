"""Per-block digests of a sealed segment's datasets: what a reader checks before it trusts a row.

HDF5's own checksum (fletcher32) needs chunked datasets; a segment's datasets are contiguous
(written once, read by row ranges), so the writer digests them itself when it seals a segment.

Invariants:

- every dataset ``T/C`` of a sealed segment (layout version >= 3), and ``commits``, has a digest
  dataset ``digests/T/C``: the crc32 of each *block* of ``rows`` consecutive rows of the data as
  stored (its attribute ``rows``; the last block may be shorter). A block is ~`BLOCK_BYTES` of data,
  at least one row; crc32 catches every single-bit flip and every burst up to 32 bits. It is
  zlib's crc32 (``zlib.crc32`` gives the same values), computed by zlib-ng's SIMD implementation,
  several times faster than zlib's (measured in bench/results/2026-12-07-ingest.md);
- a reader verifies every block a read touches (`verified`) and raises `BlockDamage` naming the
  dataset and the row range of the first bad block: damage costs the rows of that block, never
  the segment; a missing or malformed digest dataset counts as damage of the whole dataset.

Worked example: ``samples/completion_ids`` (int32) of 100,000 tokens with ``BLOCK_BYTES`` 64 KiB has
blocks of 16,384 rows: 7 digests (6 full blocks, one of 1,696 rows). Reading tokens 20,000-20,100
reads and checks rows 16,384-32,767 (block 1) only.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from zlib_ng.zlib_ng import crc32

#: Target bytes per digested block (at least one row per block).
BLOCK_BYTES = 64 * 1024
DIGESTS_GROUP = "digests"


class BlockDamage(Exception):
    """A block of a dataset fails its digest: ``name``, rows ``a``:``b`` of it."""

    def __init__(self, name: str, a: int, b: int, why: str = "fails its digest"):
        super().__init__(f"{name} rows {a}:{b} {why}")
        self.name, self.a, self.b = name, a, b


def block_rows(arr) -> int:
    """Rows per digested block of ``arr`` (an array or a dataset; see module invariants)."""
    row_bytes = max(1, arr.dtype.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64)))
    return max(1, BLOCK_BYTES // row_bytes)


def digest(parts: Sequence[np.ndarray], rows: int) -> np.ndarray:
    """crc32 of each block of ``rows`` rows of ``parts`` read as one array, in order (uint32, one
    per block): a dataset's rows in one array, or in the pieces a seal writes (a flush each),
    which are digested where they lie, never joined (a block may span pieces)."""
    out: list[int] = []
    crc = filled = step = 0
    for part in parts:
        part = np.ascontiguousarray(part)
        if not part.nbytes:
            continue
        flat = memoryview(part).cast("B")
        step = step or rows * (part.nbytes // len(part))
        at = 0
        if not filled:  # whole blocks from the part's start: one call each, no bookkeeping
            at = len(flat) // step * step
            out += [crc32(flat[k:k + step]) for k in range(0, at, step)]
        while at < len(flat):
            take = min(step - filled, len(flat) - at)
            crc = crc32(flat[at:at + take], crc)
            filled, at = filled + take, at + take
            if filled == step:
                out.append(crc)
                crc = filled = 0
    if filled:
        out.append(crc)
    return np.array(out, np.uint32)


def write_digests(f, name: str, parts: Sequence[np.ndarray], ds) -> tuple:
    """Store the digests of dataset ``name`` (``ds``) of open HDF5 file ``f``, whose rows are
    ``parts``; returns the digest dataset and its rows per block."""
    rows = block_rows(ds)
    dg = f.create_dataset(f"{DIGESTS_GROUP}/{name}", data=digest(parts, rows))
    dg.attrs["rows"] = rows
    return dg, rows


def _blocks(f, name: str) -> tuple[int, int]:
    """(rows in dataset ``name``, rows per digested block), or `BlockDamage` for the whole of it."""
    n = f[name].shape[0]
    try:
        dg = f[f"{DIGESTS_GROUP}/{name}"]
        rows = int(dg.attrs["rows"])
        if rows < 1 or dg.shape != (-(-n // rows),):
            raise ValueError(f"{dg.shape} digests of {rows} rows for {n} rows")
    except (KeyError, ValueError, TypeError, OSError) as e:
        raise BlockDamage(name, 0, n, f"have no usable digests ({e})") from None
    return n, rows


def _check(f, name: str, n: int, rows: int, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks ``first:last`` of dataset ``name``: (their data, indices of the bad ones)."""
    data = f[name][first * rows:min(last * rows, n)]
    bad = np.flatnonzero(digest([data], rows) != f[f"{DIGESTS_GROUP}/{name}"][first:last])
    return data, first + bad


def verified(f, name: str, a: int, b: int) -> np.ndarray:
    """Rows ``a:b`` of dataset ``name`` of open HDF5 file ``f``, every block they touch checked
    against its digest (`BlockDamage` naming the first bad one otherwise)."""
    n, rows = _blocks(f, name)
    a, b = max(0, a), min(b, n)
    if b <= a:
        return f[name][a:a]
    first = a // rows
    data, bad = _check(f, name, n, rows, first, -(-b // rows))
    if len(bad):
        k = int(bad[0])
        raise BlockDamage(name, k * rows, min((k + 1) * rows, n))
    return data[a - first * rows:b - first * rows]


def damaged_blocks(f, name: str) -> list[BlockDamage]:
    """Every bad block of dataset ``name`` (a full check, ~4 MiB read at a time)."""
    try:
        n, rows = _blocks(f, name)
    except BlockDamage as e:
        return [e]
    stretch = max(1, (4 << 20) // BLOCK_BYTES)
    out = []
    for first in range(0, -(-n // rows), stretch):
        _, bad = _check(f, name, n, rows, first, first + stretch)
        out += [BlockDamage(name, int(k) * rows, min((int(k) + 1) * rows, n)) for k in bad]
    return out
