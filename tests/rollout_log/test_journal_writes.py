"""`pipeline.rollout_log.journal.write_all`, the one write loop of the journal's entries and a seal's
datasets: every byte lands, in order, after short writes (from inside a buffer and at a buffer's
boundary) and across more buffers than one call takes (`IOV_MAX`); a call that writes nothing is an
error, not a loop without end. The reference is the parts joined in memory."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import pipeline.rollout_log.journal as journal
from pipeline.rollout_log.journal import JournalFile, write_all


def _parts() -> list:
    """More buffers than one call takes, of several kinds and sizes (empty ones among them)."""
    rng = np.random.default_rng(7)
    parts: list = [b"head", b"", memoryview(b"view-bytes")]
    for k in range(journal.IOV_MAX + 37):
        parts.append(rng.integers(0, 2**31, 1 + k % 700, dtype=np.int32) if k % 3 else bytes([k % 256]) * (1 + k % 5))
    parts.append(np.arange(12, dtype=np.float32).reshape(3, 4))
    return parts


def _joined(parts: list) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def _short(real):
    """A writer that writes at most 1000 bytes (calls 0, 4, 8, ...) or only the first buffer (calls
    2, 6, ...), else all it is given."""
    calls = []

    def write(fd, bufs, *offset):
        kind = len(calls) % 4
        calls.append(len(bufs))
        if kind == 0:
            return real(fd, [memoryview(bufs[0])[:1000]], *offset)
        if kind == 2:
            return real(fd, bufs[:1], *offset)
        return real(fd, bufs, *offset)
    return write, calls


@pytest.mark.parametrize("at_offset", [False, True])
def test_every_byte_lands_after_short_writes(tmp_path, monkeypatch, at_offset):
    parts = _parts()
    name = "pwritev" if at_offset else "writev"
    short, calls = _short(getattr(os, name))
    monkeypatch.setattr(journal.os, name, short)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 5)
        written = write_all(fd, parts, 3) if at_offset else write_all(fd, parts)
    finally:
        os.close(fd)
    want = _joined(parts)
    assert written == len(want)
    assert max(calls) == journal.IOV_MAX and len(calls) >= 4  # batches; short writes continued
    assert path.read_bytes() == (b"xxx" + want if at_offset else b"x" * 5 + want)


@pytest.mark.parametrize("at_offset", [False, True])
def test_a_write_of_nothing_is_an_error(tmp_path, monkeypatch, at_offset):
    name = "pwritev" if at_offset else "writev"
    monkeypatch.setattr(journal.os, name, lambda fd, bufs, *offset: 0)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as err:
            write_all(fd, [b"abc", np.zeros(4, np.int64)], 0 if at_offset else None)
    finally:
        os.close(fd)
    assert err.value.errno == errno.EIO and name in str(err.value)


def test_a_journal_entry_that_cannot_be_written_is_cut_back(tmp_path, monkeypatch):
    """The journal's append raises on a write of nothing and leaves the file at its previous end,
    so the entry can be retried (journal invariants)."""
    j = JournalFile(tmp_path / "journal-00000001.tfj")
    try:
        j.append([b"first entry"])
        real = os.writev
        monkeypatch.setattr(journal.os, "writev", lambda fd, bufs: real(fd, [memoryview(bufs[0])[:3]]) and 0)
        with pytest.raises(OSError):
            j.append([b"second", b" entry"])
        monkeypatch.undo()
        j.append([b"retried"])
    finally:
        j.close()
    assert (tmp_path / "journal-00000001.tfj").read_bytes() == b"first entryretried"
