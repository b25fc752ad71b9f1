"""Process supervision: nothing a run starts outlives it, however its parent dies.

Linux gives three tools, used together (`docs/architecture.md`, "Processes and failures"):
- a *child subreaper* (``PR_SET_CHILD_SUBREAPER``) adopts the orphans of its descendants instead
  of init, so a process whose parent was ``kill -9``'d (a vLLM ``EngineCore`` whose generator
  died) stays in the tree of the task that started it, where `end_tree` finds and ends it;
- a *parent-death signal* (``PR_SET_PDEATHSIG``) makes a child hear of its parent's death at once;
- a *marker* environment variable, inherited by every descendant, names the processes of a test or
  benchmark wherever they were reparented to (``tests/support/leftovers.py``), without matching
  process names (other runs on the same machine are not touched).

Invariants:
- `end_tree(root)` returns once no descendant of ``root`` is left (SIGTERM, then SIGKILL after
  ``grace_s``); zombies it adopted are reaped. A process that outlives SIGKILL by ``KILL_WAIT_S``
  (uninterruptible sleep: blocked in the kernel, e.g. on a network filesystem that went away) is
  named on stderr (pid, state, kernel wait channel) and left behind, so a supervisor goes on
  instead of waiting for the filesystem forever; it ends as soon as the kernel lets it;
- `descendants` reads ``/proc`` once per call; a process that forks while it is read may be missed,
  so `end_tree` re-reads until the tree is empty.

Example: a generator task runs as supervisor (subreaper, pid 100) -> generator role (pid 101,
subreaper) -> EngineCore (pid 102) -> worker (pid 103). ``kill -9 101``: 102 is reparented to 100
(the nearest living subreaper), the supervisor sees 101 exit, calls ``end_tree(100)``: SIGTERM to
102 and 103, SIGKILL to whatever is left after ``grace_s``, then restarts the role.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
MARKER_ENV = "TOKENFLOW_PROCESS_MARKER"
"""Environment variable tests and benchmarks set to a unique value; every process they start inherits it."""


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}) failed: {os.strerror(err)}")


def become_subreaper() -> None:
    """Adopt orphaned descendants of this process (they stay findable by `descendants`)."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Get ``sig`` when the parent exits (call in the child, e.g. as ``preexec_fn``)."""
    parent = os.getppid()
    _prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os.kill(os.getpid(), sig)


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (field 3, the state, first), None if
    ``pid`` is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of ``pid``, None if it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[1]), fields[0])


def wait_channel(pid: int) -> str:
    """The kernel function ``pid`` sleeps in ('-' when running, '?' when unreadable or gone)."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text() or "-"
    except OSError:
        return "?"


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (with the pid, names one process), None if it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])  # field 22 of proc(5)


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[1] != "Z"


def process_group(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    out = []
    for pid in _pids():
        fields = _stat_fields(pid)
        if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:  # field 5 of proc(5)
            out.append(pid)
    return out


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; a group already gone is no error."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def end_groups(pgids: list[int], grace_s: float, kill_wait_s: float = 10.0) -> tuple[list[int], list[int]]:
    """SIGTERM to each process group of ``pgids``, then wait until none of their processes is left;
    what is left after ``grace_s`` gets SIGKILL. Returns (the processes that got SIGKILL, those
    still present ``kill_wait_s`` after it: blocked in the kernel, normally none). A group leader
    that exited already is no reason to skip its group: the processes it started may still be in it."""
    def left_after(sig: int, wait_s: float) -> list[int]:
        for pgid in pgids:
            signal_group(pgid, sig)
        deadline = time.monotonic() + wait_s
        while any(process_group(g) for g in pgids) and time.monotonic() < deadline:
            _reap_adopted()
            time.sleep(0.1)
        return [pid for g in pgids for pid in process_group(g)]

    killed = left_after(signal.SIGTERM, grace_s)
    return killed, left_after(signal.SIGKILL, kill_wait_s) if killed else []


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(root: int) -> list[int]:
    """Live (non-zombie) descendants of ``root``, parents before children."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for pid in _pids():
        st = _stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append(pid)
            states[pid] = st[1]
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return [p for p in out if states.get(p) != "Z"]


def _reap_adopted() -> None:
    """Reap zombie children of this process that no `subprocess.Popen` owns (adopted orphans)."""
    me = os.getpid()
    for pid in _pids():
        st = _stat(pid)
        if st is not None and st[0] == me and st[1] == "Z" and _adopted(pid):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


_owned: set[int] = set()
"""Children this process started itself (their owners wait for them); never reaped here."""


def own(pid: int) -> None:
    _owned.add(pid)


def _adopted(pid: int) -> bool:
    return pid not in _owned


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_tree(root: int | None = None, grace_s: float = 10.0, spare: tuple[int, ...] = ()) -> list[int]:
    """End every descendant of ``root`` (default: this process) but ``spare``; returns the pids it
    signalled."""
    root = os.getpid() if root is None else root
    return _end(lambda: [p for p in descendants(root) if p not in spare], grace_s)


def is_resource_tracker(pid: int) -> bool:
    """Whether ``pid`` is a multiprocessing resource tracker. It ignores SIGTERM and SIGINT and ends
    by itself, unlinking the shared memory its owner's processes left, once its owner and every
    process that inherited its pipe (an engine's processes) are gone: never SIGKILL it, and do not
    wait for it while its owner lives (`own_resource_trackers`)."""
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


def own_resource_trackers() -> tuple[int, ...]:
    """This process's own resource trackers (its children): they end when it does."""
    me = os.getpid()
    return tuple(p for p in descendants(me) if (_stat(p) or (0,))[0] == me and is_resource_tracker(p))


def end_processes(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """End ``pids`` and their descendants (e.g. the engine processes a library started)."""
    def left() -> list[int]:
        out = []
        for pid in pids:
            st = _stat(pid)
            if st is not None and st[1] != "Z":
                out += [pid] + descendants(pid)
        return out

    return _end(left, grace_s)


KILL_WAIT_S = 30.0
"""How long `end_tree` waits for SIGKILLed processes to go before it leaves them behind, named."""


def _end(left_now, grace_s: float, kill_wait_s: float | None = None) -> list[int]:
    signalled: list[int] = []
    deadline = time.monotonic() + grace_s
    give_up = deadline + (KILL_WAIT_S if kill_wait_s is None else kill_wait_s)
    sig = signal.SIGTERM
    while True:
        _reap_adopted()
        left = left_now()
        if not left:
            return signalled
        now = time.monotonic()
        if now > give_up:
            stuck = [f"{pid} ({(_stat(pid) or (0, 'gone'))[1]}, waiting in {wait_channel(pid)})" for pid in left]
            print(f"tokenflow: {len(left)} process(es) outlived SIGKILL by {now - deadline:.0f} s and are left "
                  f"behind (blocked in the kernel?): {', '.join(stuck)}", file=sys.stderr, flush=True)
            return signalled
        if now > deadline:
            sig = signal.SIGKILL
        _signal_all(left, sig)
        signalled.extend(p for p in left if p not in signalled)
        time.sleep(0.1)


class KeptProcess:
    """A child process kept alive by a watcher thread: restarted when it dies, at most ``max_restarts`` times.

    ``start()`` launches it (and is called again for each restart); past the bound ``on_give_up``
    is called once with a message naming the process and its exit. `stop` ends it on purpose (no
    restart). Example: the orchestrator beside trainer rank 0 (`pipeline.roles.trainer`).

    Restarts are forked by the watcher thread, and a parent-death signal (`die_with_parent`) follows
    the thread that forked, not the process: so the watcher ends only after the process it started
    has exited, never at `release` (an earlier watcher did, and the restarted orchestrator got its
    parent-death SIGINT at the end of every run that had restarted it, while it may still have been
    restoring the log).
    """

    def __init__(self, name: str, start, max_restarts: int, on_give_up, poll_s: float = 0.2) -> None:
        import threading

        self.name, self._start, self.max_restarts, self.on_give_up = name, start, max_restarts, on_give_up
        self.poll_s = poll_s
        self.restarts = 0
        self.failure: str | None = None
        self._stopping = threading.Event()
        self.proc = start()
        own(self.proc.pid)
        self._thread = threading.Thread(target=self._watch, name=f"keep-{name}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            if self._stopping.wait(self.poll_s):  # released: it exits on purpose, no restart; this
                while self.proc.poll() is None:   # thread forked it, so it ends only after it (class doc)
                    time.sleep(self.poll_s)
                return
            code = self.proc.poll()
            if code is None:
                continue
            why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            if self.restarts >= self.max_restarts:
                self.failure = (f"the {self.name} (pid {self.proc.pid}) died ({why}) after "
                                f"{self.restarts} restart(s)")
                self.on_give_up(self.failure)
                return
            self.restarts += 1
            print(f"tokenflow: the {self.name} (pid {self.proc.pid}) died ({why}) at "
                  f"{time.strftime('%H:%M:%S')}; restart {self.restarts} of {self.max_restarts}", flush=True)
            self.proc = self._start()
            own(self.proc.pid)

    def release(self) -> None:
        """Stop restarting it (it is about to exit on purpose); the watcher ends once it has."""
        self._stopping.set()

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
        """Release it and end it: ``sig``, then SIGKILL after ``grace_s``."""
        import subprocess

        self.release()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def signal_note(line: str) -> None:
    """Write one line to stdout from a signal handler: unbuffered, never raising."""
    try:
        sys.stdout.flush()
    except (RuntimeError, ValueError, OSError):  # the handler interrupted a write to the same buffer
        pass
    try:
        os.write(sys.stdout.fileno(), (line + "\n").encode())
    except (OSError, ValueError):
        pass
