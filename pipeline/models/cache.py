"""Build-once directory cache shared by every process on the machine.

Invariants:
- A cache entry `root/name` appears only complete: it is built in a temporary sibling directory and
  renamed into place (rename within one file system is atomic).
- At most one process builds a given entry: builders hold an exclusive `flock` on `root/.name.lock`;
  the others wait (polling, with a timeout that raises a clear error) and then reuse the entry.
- A failed build leaves nothing behind but the lock file.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# Seconds a process waits for another process's build of the same entry before giving up.
LOCK_TIMEOUT_S = 900.0


def cache_root() -> Path:
    """`$TOKENFLOW_CACHE` if set, else `~/.cache/tokenflow`."""
    env = os.environ.get("TOKENFLOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenflow"


def build_once(root: Path, name: str, build: Callable[[Path], None], timeout_s: float = LOCK_TIMEOUT_S) -> Path:
    """Return `root/name`, calling `build(tmp_dir)` to create it if it does not exist yet."""
    root = Path(root)
    final = root / name
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    lock_path = root / f".{name}.lock"
    deadline = time.monotonic() + timeout_s
    with open(lock_path, "a") as lock_file:
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {timeout_s:.0f} s for another process building {final} (lock {lock_path})"
                    ) from None
                time.sleep(0.2)
        try:
            if final.is_dir():
                return final
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}.tmp-"))
            try:
                build(tmp)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return final
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
