"""vLLM's engine processes end with the process that owns the engine, however that process dies.

The *owner* is the process that builds a vLLM engine (``AsyncLLM``/``LLM``): a generator role, a
teacher scorer, a test, a benchmark. vLLM runs the engine in processes of its own: the owner spawns
``EngineCore``, which spawns one worker per rank. vLLM ends them when the owner exits normally, and a
worker leaves when its EngineCore dies (vLLM's death pipe); but EngineCore has no parent-death
option, so an owner killed with SIGKILL leaves EngineCore and its worker (≈2.2 GB for a tiny model)
running, reparented to init or to a subreaper that may be dead too (Slurm's KillWait SIGKILLs the
role and its supervisor together).

How: the owner calls `mark_owner()` right before it starts an engine. It puts ``OWNER_ENV =
"<pid>:<start time>"`` in its environment, which EngineCore and the workers inherit (and
``SPT_NOENV=1``, without which vLLM's process titles overwrite what ``/proc/<pid>/environ`` shows).
Each worker imports our worker extension (`pipeline.generator.worker_extension`), whose import calls
`watch_owner()`: a daemon thread reads the owner's ``/proc/<pid>/stat`` every `POLL_S`; once the
owner is gone (exited, a zombie, or its pid taken by another process: the start time differs) the
thread SIGKILLs the worker's parent if the parent carries the same ``OWNER_ENV`` value (EngineCore),
then the worker itself. Nothing is asked of the owner when it dies. (Where vLLM runs the worker
inside EngineCore, one rank on a GPU or on CPU (`pipeline.generator.vllm_args`), the watch runs in EngineCore: its parent is the owner, so it
ends only itself.)

The engine's local endpoints: vLLM binds the ZeroMQ sockets between the owner and EngineCore (and,
on several ranks, its workers' queues) as Unix sockets named ``<VLLM_RPC_BASE_PATH>/<uuid4>``, the
shared temp directory by default, unauthenticated, and left there when a process is killed (a
test machine had thousands). `mark_owner()` points ``RPC_DIR_ENV`` at a fresh directory of mode
0700 (`tempfile.mkdtemp`, prefix `RPC_DIR_PREFIX` and the owner's pid), so only the user's
processes can reach the engine's sockets; it is removed when the engine is shut down
(`release_rpc_dir`: `pipeline.generator.engine.Generator.shutdown`, a teacher scorer's `close` at
its role's end), when the owner exits normally (atexit), or, once the owner is gone, by the watch
below before it ends the engine. A path the user set (not one of ours) is kept. While an engine
starts (`private_engine_temp`), its processes get that directory as ``TMPDIR`` too, so the temp
files vLLM leaves when killed (a one-rank engine's ``vllm_dist_<uuid>`` file store, ~600 found in
a test machine's ``/tmp``) go with it; torch inductor's cache stays where it was (its precompiled
headers through a link, `private_engine_temp`). A role that fails ends its engine with its process
tree and leaves through ``os._exit``, past atexit: it releases the directory first
(`pipeline.launch.task`).

Invariants:
- only processes carrying the owner's token are ended, i.e. descendants of the owner started after
  it called `mark_owner()`; never the owner, never a process outside its tree (a subreaper that
  adopted the engine, another run's engine);
- an engine process ends within ``POLL_S`` plus the kernel's kill latency of its owner's death; a
  worker that starts after its owner died ends at once (not covered: an owner dying in the first
  second of start-up, before EngineCore has spawned its worker: EngineCore then gives up on its
  handshake with the owner after vLLM's handshake timeout, 5 minutes);
- at most one watch per process; in the owner itself, and in a process without ``OWNER_ENV``,
  `watch_owner()` does nothing;
- while the owner lives, no stop signal ends a worker: it ignores them (`ignore_stop_signals`);
  the owner ends its engine.

Example: a generator role, pid 4100 started at clock tick 88120, calls `mark_owner()`
(``TOKENFLOW_ENGINE_OWNER=4100:88120``) and starts ``AsyncLLM``: EngineCore 4130 and its worker 4152
inherit the token. Slurm SIGKILLs 4100 and its supervisor at t = 0. By t = 0.5 s the watch thread in
4152 finds 4100 gone, SIGKILLs 4130 (its parent, same token), then 4152; the multiprocessing resource
tracker 4100 started exits once 4152, the last holder of its pipe, is gone.
"""
from __future__ import annotations

import atexit
import getpass
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipeline.supervise import alive, start_time

OWNER_ENV = "TOKENFLOW_ENGINE_OWNER"
"""``<pid>:<start time in clock ticks>`` of the process that owns the engine; inherited by its processes."""
KEEP_ENVIRON_ENV = "SPT_NOENV"
"""Tells ``setproctitle`` (vLLM titles its processes ``VLLM::EngineCore``, ``VLLM::Worker``) to leave
``/proc/<pid>/environ`` readable: by default it writes the title over the environment block, which
hides ``OWNER_ENV`` and the tests' ``MARKER_ENV`` from every reader of ``/proc``."""
POLL_S = 0.5
"""How often a watch looks at its owner."""
RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"
"""vLLM's directory for its engine's Unix sockets (module docstring); inherited by its processes."""
RPC_DIR_PREFIX = "tf-engine-"
"""An owner's socket directory is ``<temp dir>/tf-engine-<owner pid>-<random>`` (short: a socket's
path, ``<directory>/<uuid4>``, must fit the 107 bytes of a Unix socket address)."""
SOCKET_PATH_MAX = 107
"""Longest path of a Unix socket address (``sun_path`` less its terminating NUL)."""

_watching: int | None = None  # the pid whose watch thread runs (a forked child must start its own)


def mark_owner() -> str:
    """Name this process the owner of the engines it starts from now on; returns the token."""
    pid = os.getpid()
    token = f"{pid}:{start_time(pid)}"
    os.environ[OWNER_ENV] = token
    os.environ[KEEP_ENVIRON_ENV] = "1"
    current = os.environ.get(RPC_DIR_ENV)
    users = current is not None and not _owned_rpc_dir(current, None)  # the user's own choice: kept
    mine = current is not None and _owned_rpc_dir(current, pid) and os.path.isdir(current)
    if not users and not mine:  # none yet, released, or a parent owner's (inherited)
        path = _new_rpc_dir(pid)
        os.environ[RPC_DIR_ENV] = path
        atexit.register(_remove_rpc_dir, path, pid)
    return token


def _new_rpc_dir(pid: int) -> str:
    """A fresh directory of mode 0700 for owner ``pid``'s sockets: in the temp directory, or in
    ``/tmp`` where the temp directory is too deep for a socket's path (``<directory>/<uuid4>``)."""
    for base in dict.fromkeys((tempfile.gettempdir(), "/tmp")):
        # <base>/<prefix><pid>-<mkdtemp's 8 characters>/<uuid4, 36 characters>
        longest = len(os.fsencode(base)) + len(f"/{RPC_DIR_PREFIX}{pid}-") + 8 + 1 + 36
        if longest <= SOCKET_PATH_MAX and os.path.isdir(base):
            return tempfile.mkdtemp(prefix=f"{RPC_DIR_PREFIX}{pid}-", dir=base)
    raise ValueError(f"vLLM's engine sockets would not fit a Unix socket address ({SOCKET_PATH_MAX} "
                     f"bytes) under the temp directory {tempfile.gettempdir()!r}, and there is no "
                     "/tmp: set TMPDIR to a shorter path")


def release_rpc_dir() -> None:
    """Remove this owner's socket directory (its engines are shut down); the next `mark_owner`
    makes a new one."""
    path = os.environ.get(RPC_DIR_ENV)
    if path is not None and _owned_rpc_dir(path, os.getpid()):
        del os.environ[RPC_DIR_ENV]
        _remove_rpc_dir(path, os.getpid())


@contextmanager
def private_engine_temp() -> Iterator[None]:
    """While an engine of this owner starts (vLLM spawns its processes meanwhile): ``TMPDIR`` is
    the owner's socket directory, ``TORCHINDUCTOR_CACHE_DIR`` pinned to the place inductor would
    use by default (``torchinductor_<user>`` in the temp directory), so a compiled engine still
    finds its cache. Inductor keeps its precompiled headers under that default place whatever
    ``TORCHINDUCTOR_CACHE_DIR`` says (it takes the temp directory at import), so the owner's
    directory gets a link of that name to it: a vLLM CPU engine precompiles one header at its
    start (~5 CPU s of ``cc1plus``), found there by every later engine instead of compiled again
    by each (removing the directory removes the link, never what it points to). The owner's own
    environment is restored after; nothing changes without a socket directory of this owner
    (`mark_owner`)."""
    path = os.environ.get(RPC_DIR_ENV)
    if path is None or not _owned_rpc_dir(path, os.getpid()):
        yield
        return
    saved = {name: os.environ.get(name) for name in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container): inductor's own fallback name
        user = f"uid_{os.getuid()}"
    inductor = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor)
    os.makedirs(inductor, exist_ok=True)
    link = os.path.join(path, os.path.basename(inductor))  # inductor's default place seen from the new TMPDIR
    if not os.path.islink(link):
        os.symlink(inductor, link)
    os.environ["TMPDIR"] = path
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _owned_rpc_dir(path: str, pid: int | None) -> bool:
    """Whether ``path`` is a socket directory of ours (of owner ``pid``, any owner if None)."""
    name = os.path.basename(path.rstrip("/"))
    return name.startswith(RPC_DIR_PREFIX if pid is None else f"{RPC_DIR_PREFIX}{pid}-")


def _remove_rpc_dir(path: str, pid: int) -> None:
    if _owned_rpc_dir(path, pid):  # never another owner's, never a path the user chose
        shutil.rmtree(path, ignore_errors=True)


def _owner_alive(pid: int, started: int) -> bool:
    return alive(pid) and start_time(pid) == started


def _carries(pid: int, token: str) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return f"{OWNER_ENV}={token}".encode() in env.split(b"\0")


def _end_when_gone(pid: int, started: int, token: str) -> None:
    while _owner_alive(pid, started):
        time.sleep(POLL_S)
    parent = os.getppid()
    engine_core = parent != pid and _carries(parent, token)
    print(f"tokenflow: engine owner {pid} is gone; ending engine process {os.getpid()}"
          + (f" and its parent {parent}" if engine_core else ""), file=sys.stderr, flush=True)
    _remove_rpc_dir(os.environ.get(RPC_DIR_ENV, ""), pid)  # the dead owner's sockets
    if engine_core:
        os.kill(parent, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals an engine worker ignores while its owner lives (`ignore_stop_signals`)."""


def ignore_stop_signals() -> bool:
    """In an engine worker of an owner (``OWNER_ENV`` set, another process), from its main thread:
    ignore the stop signals, whatever handler vLLM installed, so a signal to the whole process group
    never ends a worker before its owner ends the engine (SIGKILL): a worker that ended on it left
    its EngineCore stepping into a dead executor (a fatal ``AssertionError`` in the log). Blocking
    them in the owner before the engine's start did not suffice: a SIGTERM sent to a worker, or to
    EngineCore, was not always left pending (some thread took it), and Python then ran vLLM's
    handler. Returns whether the signals are ignored now."""
    token = os.environ.get(OWNER_ENV)
    if not token or int(token.partition(":")[0]) == os.getpid():
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    return True


def watch_owner() -> bool:
    """In an engine process: end it (and its EngineCore parent) once the owner named by ``OWNER_ENV``
    is gone. Returns whether a watch runs in this process now."""
    global _watching
    token = os.environ.get(OWNER_ENV)
    if _watching == os.getpid() or not token:
        return _watching == os.getpid()
    pid_text, _, started_text = token.partition(":")
    pid, started = int(pid_text), int(started_text)
    if pid == os.getpid():
        return False
    _watching = os.getpid()
    threading.Thread(target=_end_when_gone, args=(pid, started, token), name="tokenflow-owner-watch",
                     daemon=True).start()
    return True
