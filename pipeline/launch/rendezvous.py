"""Rendezvous through the run directory (and, where the tasks run under MPI, through mpi4py).

Each role publishes what others need to reach it (address, ports, a run secret) as a small JSON
file; others wait for it with a timeout. Files live in `RUN/rendezvous/attempt-<n>/<key>.json`, so
a requeued job (attempt n+1) never reads an address left behind by the attempt before it.

Invariants:
- a published file is complete or absent: written to a temporary name, fsynced, then renamed;
- `wait` never blocks longer than its timeout and its error names the missing key and the keys
  that were present;
- the MPI path (`mpi_broadcast`, `mpi_bootstrap`) is optional: mpi4py is imported only when called,
  and the payload crosses MPI as UTF-8 JSON bytes (no pickle);
- `mpi_bootstrap` is collective over every task of the job step and finalizes MPI before it returns,
  so the role processes a task starts (and restarts) afterwards never touch MPI.

Example: the orchestrator (trainer rank 0's node) calls
`Rendezvous(run_dir, attempt).publish("orchestrator", {"host": "node1", "port": 5555})`; each
generator calls `.wait("orchestrator", timeout_s=120)` and gets that dict.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Dict, Optional

from pipeline.run_files import RENDEZVOUS_DIR

_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")

#: Environment variable of a role process whose component bootstrapped from MPI: JSON
#: {"rank", "size", "host", "port"} of its process group's master (see `mpi_bootstrap`).
DIST_ENV = "TOKENFLOW_DIST_BOOTSTRAP"


class RendezvousTimeout(TimeoutError):
    """A rendezvous key did not appear in time."""


class Rendezvous:
    """Publish/wait key -> JSON dict for one attempt of one run."""

    def __init__(self, run_dir: os.PathLike | str, attempt: int) -> None:
        self.directory = Path(run_dir) / RENDEZVOUS_DIR / f"attempt-{attempt}"

    def _path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"rendezvous key {key!r} must match {_KEY.pattern}")
        return self.directory / f"{key}.json"

    def publish(self, key: str, info: Dict[str, Any]) -> Path:
        """Atomically write `info` under `key`; overwriting an earlier value of the same attempt is allowed."""
        path = self._path(key)
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        """The published value of `key`, or None if it is not there yet."""
        try:
            with open(self._path(key)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def wait(self, key: str, timeout_s: float, poll_s: float = 0.05) -> Dict[str, Any]:
        """Block until `key` is published (at most timeout_s seconds)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.get(key)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                present = sorted(p.stem for p in self.directory.glob("*.json")) if self.directory.exists() else []
                raise RendezvousTimeout(
                    f"rendezvous key {key!r} not published in {self.directory} within {timeout_s:g} s "
                    f"(present: {present or 'nothing'})")
            time.sleep(poll_s)


def running_attempt(run_dir: os.PathLike | str, timeout_s: float = 0.0) -> int:
    """The attempt of the run now going in ``run_dir``: the newest one whose trainer rank 0
    published its address (``trainer_dist``), waiting up to ``timeout_s`` for one. A generator job
    that joins a running run (`pipeline.launch.generator_jobs`) takes part in this attempt."""
    root = Path(run_dir) / RENDEZVOUS_DIR
    deadline = time.monotonic() + timeout_s
    while True:
        attempts = [int(d.name.split("-", 1)[1]) for d in root.glob("attempt-*")
                    if d.name.split("-", 1)[1].isdigit() and (d / "trainer_dist.json").exists()]
        if attempts:
            return max(attempts)
        if time.monotonic() >= deadline:
            raise RendezvousTimeout(f"no attempt of the run in {run_dir} has a trainer yet (no "
                                    f"{root}/attempt-*/trainer_dist.json after {timeout_s:g} s): is it running?")
        time.sleep(0.5)


def listen_on(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host``'s address only (port 0: one the kernel picks), for a
    server to take over (a TCPStore's ``master_listen_fd``). Bound before its port is published,
    so no other process can take the port in between (`free_port`'s race)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(1024)
    except OSError as exc:
        listener.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from exc
    return listener


def open_store(host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta,
               listener: "socket.socket | None" = None):
    """A TCPStore: the weight group's (`pipeline.weights.group`), the trainer's process group's
    (`pipeline.roles.trainer`, `bootstrap_store`). Rank 0 (``is_master``) serves it on ``listener``,
    a socket it bound and published before (`listen_on`: no port race), or else on a socket bound
    to ``host:port`` here; either way on ``host``'s address only."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if listener is None:
        listener = listen_on(host, port)
    try:
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket now
    return store


def bootstrap_store(boot: Dict[str, Any], timeout_s: float):
    """The TCPStore of the process group `mpi_bootstrap` placed this process in (``boot``, from
    DIST_ENV): rank 0 serves it on the socket its task's supervisor bound and handed down
    (``listen_fd``), the others connect to the published ``host:port``."""
    listener = socket.socket(fileno=boot["listen_fd"]) if "listen_fd" in boot else None
    return open_store(boot["host"], boot["port"], boot["size"], boot["rank"] == 0,
                      datetime.timedelta(seconds=timeout_s), listener)


LOWEST_FREE_PORT = 20000
"""`free_port` picks at random from here up to the kernel's ephemeral range (below it)."""


def free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago on this host, below the kernel's ephemeral range
    (``net.ipv4.ip_local_port_range``, 32768-60999 by default), so that no outgoing connection and no
    ``bind(port 0)`` of another process takes it before the caller binds it (a port the kernel picks
    for those comes from that range: a busy machine took one in between). Still racy against another
    caller of `free_port` (a random pick of ~12,700): a server that can take a bound socket uses
    `listen_on` instead. Where the range leaves no room below it, a port the kernel picks."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.SystemRandom()
    for _ in range(64 if low > LOWEST_FREE_PORT else 0):
        port = pick.randrange(LOWEST_FREE_PORT, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def under_mpi() -> bool:
    """Whether the process was launched under MPI (PMIx/mpirun: their variables are in the environment)."""
    return any(k in os.environ for k in ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK"))


def mpi_broadcast(comm: Any, info: Optional[Dict[str, Any]], root: int = 0) -> Dict[str, Any]:
    """Broadcast the root's JSON dict to every rank of `comm` (as bytes, no pickle); returns it on all ranks."""
    import numpy as np

    payload = json.dumps(info).encode() if comm.Get_rank() == root else b""
    size = np.array([len(payload)], dtype=np.int64)
    comm.Bcast(size, root=root)
    buf = np.frombuffer(payload, dtype=np.uint8).copy() if comm.Get_rank() == root else np.empty(int(size[0]), np.uint8)
    comm.Bcast(buf, root=root)
    return json.loads(buf.tobytes().decode())


def mpi_bootstrap(component: int, rank: int, size: int, host: str, timeout_s: float = 300.0) -> Dict[str, Any]:
    """Rank, size and master address of this task's component, from MPI instead of files.

    Every task of the step calls it (MPI_Init, then collective over COMM_WORLD): the tasks are split by
    `component` (their index in the plan), MPI's rank and size in the split must equal the plan's
    (`rank`, `size`: otherwise a ValueError names both), and the component's rank 0 binds a socket
    on ``host`` (`listen_on`) and broadcasts ``host`` and its port. Returns {"rank", "size", "host",
    "port"}, on rank 0 with "listen_fd": that socket, inheritable, for the role process to serve its
    process group's store on (`bootstrap_store`; the supervisor keeps it across role restarts), so
    the broadcast port is the one listening. MPI is finalized.
    MPI_Init (importing mpi4py's MPI) and MPI's collectives have no timeout of their own:
    `faulthandler`'s timer (a C thread, so it fires inside a blocking MPI call), armed before the
    import, prints where the task waited and ends it (exit 1) after `timeout_s`.
    """
    import faulthandler

    # C-level timer: it fires even while a blocking MPI call holds the interpreter
    print(f"MPI bootstrap: waiting for every task of the step (at most {timeout_s:g} s)", flush=True)
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    from mpi4py import MPI  # MPI_Init: connects to the launcher's PMIx server

    comm = MPI.COMM_WORLD
    sub = comm.Split(color=component, key=comm.Get_rank())
    placed = (sub.Get_rank(), sub.Get_size())
    listener = listen_on(host) if placed[0] == 0 else None
    master = mpi_broadcast(sub, {"host": host, "port": listener.getsockname()[1]} if listener else None)
    sub.Free()
    MPI.Finalize()  # after the broadcast on every task, so a disagreeing task cannot leave the others waiting
    faulthandler.cancel_dump_traceback_later()
    if placed != (rank, size):
        raise ValueError(f"MPI places this task at rank {placed[0]} of {placed[1]} in its component, the plan "
                         f"at rank {rank} of {size}: the launcher and the plan disagree")
    if listener is None:
        return {"rank": rank, "size": size, **master}
    listener.set_inheritable(True)
    return {"rank": rank, "size": size, **master, "listen_fd": listener.detach()}
