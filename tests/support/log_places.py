"""Where the rollout log tests put a log: a local directory, or the loopback network filesystem.

``scripts/netfs.sh start`` (CI runs it) mounts one exported directory twice as fuse.sshfs and
writes the two mount points to ``$TOKENFLOW_NETFS/ready`` (default /var/tmp/tokenflow-netfs):
a writer uses the first mount, readers the second, as two nodes would.
"""
from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from pipeline.rollout_log.format import filesystem_type

NETFS_ROOT = Path(os.environ.get("TOKENFLOW_NETFS", "/var/tmp/tokenflow-netfs"))


def netfs_mounts() -> tuple[tuple[Path, Path] | None, str | None]:
    """((writer mount, reader mount), None), or (None, why not)."""
    ready = NETFS_ROOT / "ready"
    if not ready.is_file():
        return None, (f"no loopback network filesystem: {ready} is missing (run "
                      "`sudo bash scripts/netfs.sh start`; CI does)")
    mounts = tuple(Path(p) for p in ready.read_text().split())
    if len(mounts) != 2 or any(filesystem_type(m) != "fuse.sshfs" for m in mounts):
        return None, f"{ready} names {mounts}, which are not two fuse.sshfs mounts"
    return mounts, None


@pytest.fixture(params=["local", "netfs"])
def place(request, tmp_path):
    """(directory a writer uses, the same directory as another node's reader sees it)."""
    if request.param == "local":
        yield tmp_path, tmp_path
        return
    with netfs_dir("test") as pair:
        yield pair


@contextmanager
def netfs_dir(prefix: str) -> Iterator[tuple[Path, Path]]:
    """A fresh directory on the network filesystem, (through the writer's mount, through the
    reader's), removed afterwards; the test is skipped, saying why, when the mounts are absent."""
    mounts, why = netfs_mounts()
    if why:
        pytest.skip(why)
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    (mounts[0] / name).mkdir()
    try:
        yield mounts[0] / name, mounts[1] / name
    finally:
        shutil.rmtree(mounts[0] / name, ignore_errors=True)


def list_segments(log_dir: Path) -> list[tuple[int, Path]]:
    """(index, path) of every segment file in ``log_dir``, in index order."""
    from pipeline.rollout_log.format import SEGMENT_RE
    return sorted((int(m.group(1)), p) for p in log_dir.iterdir()
                  if (m := SEGMENT_RE.match(p.name)) and p.is_file())


def readable_rows(log) -> int:
    """Rows a `RolloutLog` can read (its segments' rows; rows lost to damage excluded)."""
    return sum(s.num_rows for s in log.segments)
