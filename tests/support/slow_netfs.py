"""A slow filesystem stand-in: the loopback network filesystem (``scripts/netfs.sh``) mounted once
more through a relay that passes at most ``rate`` bytes per second towards the server.

Why this one: it is a real network filesystem (fuse.sshfs, the same export and sshd the netfs tests
use) whose writes are slow for the reason a cluster's are, a link the data must cross, and it
needs nothing this machine lacks. A cgroup io throttle (``io.max``, blkio) limits only direct I/O
to a block device, not the page-cache writes and fsyncs a checkpoint makes; ``dm-delay`` needs a
device-mapper target and a spare block device; a FUSE filesystem of our own would need a FUSE
library the environment does not have.

`throttled_mount(mountpoint, rate)` mounts a fresh directory of the export at ``mountpoint``
(sshfs with ``ProxyCommand`` = this file as a relay: stdin -> the sshd at ``rate`` bytes/s, the
sshd -> stdout unthrottled) and unmounts it on exit (the relay ends with its ssh).
"""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

NETFS_PORT = 2222
CHUNK = 16 * 1024


def _relay(rate: float, host: str, port: int) -> None:
    conn = socket.create_connection((host, port), timeout=30)
    conn.settimeout(None)

    def down() -> None:  # server -> ssh: unthrottled
        while True:
            data = conn.recv(1 << 16)
            if not data:
                break
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

    threading.Thread(target=down, daemon=True).start()
    free_at = time.monotonic()  # when the link is free again: no credit is saved up while idle
    stdin = sys.stdin.buffer.raw
    while True:  # ssh -> server: each chunk takes len / rate seconds of the link
        data = stdin.read(CHUNK)
        if not data:
            break
        conn.sendall(data)
        free_at = max(free_at, time.monotonic()) + len(data) / rate
        wait = free_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    conn.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def throttled_mount(mountpoint: Path, rate: float, netfs_root: Path):
    """Mount a new directory of the netfs export at ``mountpoint``, writes limited to ``rate`` bytes/s."""
    sub = netfs_root / "export" / f"slow-{uuid.uuid4().hex[:10]}"
    sub.mkdir()
    mountpoint.mkdir(parents=True, exist_ok=True)
    proxy = f"{sys.executable} {Path(__file__).resolve()} {rate:.0f} 127.0.0.1 {NETFS_PORT}"
    opts = ",".join([f"ProxyCommand={proxy}", f"IdentityFile={netfs_root}/ssh/client", "StrictHostKeyChecking=no",
                     "UserKnownHostsFile=/dev/null", "BatchMode=yes", "dir_cache=no", "attr_timeout=0",
                     "entry_timeout=0", "negative_timeout=0"])
    subprocess.run(["sshfs", "-o", opts, f"root@127.0.0.1:{sub}", str(mountpoint)], check=True, timeout=60)
    try:
        yield mountpoint
    finally:
        subprocess.run(["fusermount", "-u", str(mountpoint)], timeout=60)
        if any(line.split()[1] == str(mountpoint) for line in Path("/proc/self/mounts").read_text().splitlines()):
            subprocess.run(["fusermount", "-uz", str(mountpoint)], timeout=60)
        shutil.rmtree(sub, ignore_errors=True)


if __name__ == "__main__":  # the ProxyCommand: RATE HOST PORT
    _relay(float(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
