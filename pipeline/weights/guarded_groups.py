"""The process groups of one weight-channel end and what bounds them: the channel's failure state machine.

One `GuardedGroups` holds the torch.distributed groups a `TorchDistChannel` end belongs to (one
per sender, `pipeline.weights.group`) and is the only code that forms, drives and ends them, the
same for gloo and NCCL:

- forming: the groups are built from the channel's store and every one of them carries one
  handshake broadcast (an int64 from its sender, checked by every receiver) before the channel
  exists. So "formed" means every member connected and moved data, not only that the store
  answered: gloo connects its full mesh in the constructor; NCCL connects lazily by default, so
  its communicator is made non-blocking (an init waiting for a missing member can be aborted)
  and connected at once (`eager_connect_single_device`). A member that never arrives fails the
  forming within ``timeout_s``;
- ready: every broadcast is registered with a deadline (its start + ``timeout_s``) with the
  watchdog, a thread of this object's own; a wait polls the broadcast's completion (NCCL's
  ``wait`` does not block the host, so a host-side wait is a poll on every backend);
- failed: the first broadcast past its deadline (seen by the watchdog, also while nobody waits
  on it: an NCCL kernel that never ends holds every later host sync on its device) or the first
  error aborts every group (``abort()``; never ``shutdown()``, which waits for peers that may be
  gone, and never PyTorch's watchdog teardown of the process: NCCL groups are built with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, abort only; the backends' own timeouts are longer than
  ours, so our deadline acts first). Every later call raises `WeightSyncError` naming the first failure;
- closed: `close` aborts the groups too (a peer may be gone) and stops the watchdog.

The caller (`pipeline.roles.weight_push`, the generator's worker) regroups on `WeightSyncError`:
the next group is formed from the survivors (docs/weight-sync.md, "A dead peer").

Example: a receiver of a 3-member group is stopped (SIGSTOP) while the sender streams bucket 4;
bucket 4's broadcast is past its deadline ``timeout_s`` after it started; the watchdog aborts the
groups, the sender's wait raises "bucket 4/9 of version 7 not complete within 5 s", the other
receiver's wait raises the same way at its own deadline, and both join epoch + 1 without it.
On gloo, ``abort()`` does not end a broadcast in progress (torch 2.13: gloo's own operation ends
at gloo's timeout, `BACKEND_TIMEOUT_MARGIN_S` after ours); the wait raises at our deadline all the
same, and the failed group's buffers stay referenced by that operation until it ends.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch

WATCH_S = 0.05
"""How often the watchdog looks at the deadlines (a failure is seen at most this late)."""
POLL_MAX_S = 0.002
"""Longest sleep between two polls of a broadcast's completion (the polls start at 50 us)."""
BACKEND_TIMEOUT_MARGIN_S = 5.0
"""gloo's and NCCL's own timeouts are ours plus this, so that our deadline always acts first (the
backend's timeout only ends what our abort could not: a gloo operation in progress)."""
NCCL_ERROR_HANDLING = "2"
"""TORCH_NCCL_ASYNC_ERROR_HANDLING while an NCCL group is built (read by its constructor): abort
the communicators on an asynchronous error, never tear the process down."""


class WeightSyncError(RuntimeError):
    """A weight update could not be sent or received (peer died, timeout, malformed metadata)."""


ADDRESS_ENV = "TOKENFLOW_NETWORK_ADDRESS"
"""The address this process's gloo groups listen on (set from ``cluster.network.address``,
`pipeline.launch.network`); unset: gloo's default device (GLOO_SOCKET_IFNAME, else the host name)."""


class GuardedGroups:
    """The groups of one channel end: ``members[s] = (local rank, size)`` in the group of sender s,
    all built on the store ``connect()`` returns (called on the forming thread: its connection
    counts against the deadline too)."""

    def __init__(self, connect: Callable[[], Any], members: dict[int, tuple[int, int]], prefix: str,
                 backend: str, device: "torch.device", timeout_s: float, handshake: int) -> None:
        self.backend, self.device, self.timeout_s = backend, device, timeout_s
        self.failure: str | None = None
        self.store: Any = None
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[float, str, Any]] = {}  # id -> (deadline, what, work or None)
        self._ids = itertools.count()
        self._groups: dict[int, Any] = {}
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="tokenflow-weight-watchdog")
        self._watchdog.start()
        try:
            self._form(connect, members, prefix, handshake)
        except BaseException:
            self.close()
            raise

    # -- forming ---------------------------------------------------------------------------------
    def _form(self, connect: Callable[[], Any], members: dict[int, tuple[int, int]], prefix: str,
              handshake: int) -> None:
        """Connect the store, then build (NCCL: and connect) each group and carry its handshake, in
        sender order, on a thread of its own, waiting for it until the deadline: a call blocked in
        C++ (a store client retrying its connection, gloo waiting for its peers' addresses and then
        for each connection, each up to its own timeout) cannot hold the channel past it. Groups
        built after the channel failed are aborted by that thread. Each group's handshake comes
        right after it formed, before the next group: a receiver's group of sender 1 forms only once
        sender 1 joins, which it does after the leader's channel (group 0 and its handshake) formed
        (`pipeline.roles.weight_push`)."""
        import torch.distributed as dist

        outcome: dict[str, BaseException] = {}

        def build() -> None:
            try:
                if self.backend == "nccl":  # a new thread's current device is GPU 0 (see `group.cuda_device`)
                    import torch
                    torch.cuda.set_device(self.device)
                self.store = connect()
                for s, (rank, size) in members.items():
                    group = self._new_group(dist.PrefixStore(f"{prefix}/src{s}", self.store), rank, size)
                    with self._lock:
                        failed = self.failure is not None
                        if not failed:
                            self._groups[s] = group
                    if failed:
                        group.abort()
                        return
                    if self.backend == "nccl":  # connect now, abortable by the watchdog (gloo connected already)
                        group.eager_connect_single_device(self.device)
                    self._handshake(s, rank, handshake)
            except BaseException as e:  # handed to the waiting thread
                outcome["error"] = e

        thread = threading.Thread(target=build, daemon=True, name="tokenflow-weight-form")
        with self.bounded("forming the weight group"):
            thread.start()
            while thread.is_alive() and self.failure is None:
                thread.join(WATCH_S)
            if "error" in outcome:
                raise outcome["error"]

    def _new_group(self, store: Any, rank: int, size: int) -> Any:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s + BACKEND_TIMEOUT_MARGIN_S)
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            address = os.environ.get(ADDRESS_ENV)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address) if address
                             else dist.ProcessGroupGloo.create_default_device()]
            return dist.ProcessGroupGloo(store, rank, size, opts)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.config.blocking = 0  # a non-blocking communicator: its init can be aborted
        with _environment("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERROR_HANDLING):
            return dist.ProcessGroupNCCL(store, rank, size, opts)

    def _handshake(self, source: int, rank: int, value: int) -> None:
        """One broadcast on sender ``source``'s group, from it: every member connected and moved data."""
        import torch

        tensor = torch.full((1,), value if rank == 0 else -1, dtype=torch.int64, device=self.device)
        self.wait(self.start(source, tensor, f"the handshake of sender {source}'s group"))
        got = int(tensor.item())
        if got != value:
            raise WeightSyncError(f"the handshake of sender {source}'s group carried {got}, expected {value}: "
                                  f"another group's member at this address?")

    # -- collectives -----------------------------------------------------------------------------
    def start(self, source: int, tensor: "torch.Tensor", what: str) -> tuple[int, Any]:
        """Start the broadcast of ``tensor`` on sender ``source``'s group; a handle for `wait`."""
        import torch.distributed as dist

        self.check()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s + BACKEND_TIMEOUT_MARGIN_S)
        try:
            work = self._groups[source].broadcast([tensor], opts)
        except RuntimeError as e:
            self.fail(f"{what} failed to start: {e}")
            raise WeightSyncError(self.failure) from e
        key = next(self._ids)
        with self._lock:
            self._pending[key] = (time.monotonic() + self.timeout_s, what, work)
        return key, work

    def wait(self, handle: tuple[int, Any]) -> None:
        """Until the broadcast completed; `WeightSyncError` once the channel failed (its deadline
        passed, a peer died, another broadcast failed)."""
        key, work = handle
        pause = 5e-5
        while not work.is_completed():
            self.check()
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        with self._lock:
            _, what, _ = self._pending.pop(key, (0.0, "a broadcast", None))
        try:
            work.wait()  # raises the broadcast's error; NCCL: orders the current stream after it
        except RuntimeError as e:
            self.fail(f"{what} failed (did a peer die?): {e}")
        self.check()

    @contextlib.contextmanager
    def bounded(self, what: str) -> Iterator[None]:
        """A blocking step that is no broadcast (forming a group): aborted at its deadline."""
        key = next(self._ids)
        with self._lock:
            self._pending[key] = (time.monotonic() + self.timeout_s, what, None)
        try:
            yield
        except (RuntimeError, OSError) as e:
            self.fail(f"{what} failed: {e}")
        finally:
            with self._lock:
                self._pending.pop(key, None)
        self.check()

    def check(self) -> None:
        if self.failure is not None:
            raise WeightSyncError(self.failure)

    # -- failing and ending ----------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """Record the first failure and abort every group (idempotent; any thread)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            groups = list(self._groups.values())
        for group in groups:
            with contextlib.suppress(RuntimeError):
                group.abort()

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_S):
            now = time.monotonic()
            with self._lock:
                late = [what for deadline, what, work in self._pending.values()
                        if now > deadline and (work is None or not work.is_completed())]
            if late:
                self.fail(f"{late[0]} not complete within {self.timeout_s:g} s (watchdog)")

    def close(self) -> None:
        """Abort every group (never ``shutdown``) and stop the watchdog; later calls fail."""
        self.fail(self.failure or "the weight channel is closed")
        self._stopped.set()
        with self._lock:
            left = [self._groups.copy(), self._pending.copy(), self.store]
            self._groups.clear()
            self._pending.clear()
            self.store = None
        # A group's destructor waits for its operations in progress (gloo: up to its own timeout,
        # `BACKEND_TIMEOUT_MARGIN_S` after ours): the last references are dropped on a thread of
        # their own, so closing a failed channel returns at once; the interpreter's exit waits for
        # that thread (`_join_reapers`: a group destroyed while the process exits aborts it).
        reaper = threading.Thread(target=left.clear, daemon=True, name="tokenflow-weight-reap")
        _REAPERS[:] = [r for r in _REAPERS if r.is_alive()] + [reaper]
        reaper.start()
        del left


_REAPERS: list[threading.Thread] = []


@atexit.register
def _join_reapers() -> None:
    for reaper in _REAPERS:
        reaper.join(BACKEND_TIMEOUT_MARGIN_S + 5.0)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
