"""A lagged teacher's receiving end of the weight channel: every policy version the trainer pushes
arrives here, and the versions the teacher will switch to later are kept in host memory.

The teacher process is one more receiver rank of the trainer's weight group (`pipeline.weights.
group`, `docs/weight-sync.md`): the scorer pool lists it among the group's members as
``teacher-<rank>`` and forwards the orchestrator's regroups and update announcements to it
(`pipeline.scorers.pool`), which the process's socket loop hands to this follower's own thread
at once (requests are scored on another thread, `pipeline.scorers.role`): the receive runs beside
the engine's scoring and the trainer waits for the teacher no longer than for a generator.

Invariants:
- every update announced into the group it is in is received whole, in order; a new group is
  joined in the background (`GroupBuild`), as a generator does: the trainer keeps broadcasting into
  the group in use while the next one forms, and the follower switches to the new group (waiting
  for it to form, at most its timeout) when an update announced into it arrives. A group that does
  not list this teacher, or one already superseded by a newer, is not joined; an update announced
  into a newer group it is not joining means the trainer left this teacher out: the old channel is
  closed. An update announced without its group (epoch 0) goes into the newest group joined. A failed
  receive closes the channel until the next regroup, as a generator does;
- a version ``u`` is kept (copied to host memory) only if a lagged teacher can still ask for it:
  ``u > 0`` (0 is the initial checkpoint) a multiple of the refresh interval M (`lagged_teacher_version`), and not older than the
  version due while the policy is at v - 1 (a request sent before v was reported may still be
  queued) for the newest version v received. Older snapshots are dropped on each receive and on
  each `take`, so with lag K the follower holds at most floor(K / M) + 2 snapshots (the multiples
  of M in [due(v - 1), v]; one fewer once the due one is loaded into the engine). Host memory:
  that many copies of the weights (float32 of the trainer's parameters).

Worked example, K = 2, M = 3: versions 1..9 arrive. Kept: 3, 6, 9. After version 6 the due
version (at policy 5) is 3: held {3, 6} (2 = floor(2/3) + 2); the teacher takes 3 when asked
(policy at 5..7): held {6}; after 9 (due at 8: 6): held {6, 9}.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

from pipeline.scorers.pool import lagged_teacher_version
from pipeline.weights.group_build import GroupBuild, take_joined

if TYPE_CHECKING:
    import torch

    from pipeline.launch.rendezvous import Rendezvous

log = logging.getLogger(__name__)


class WeightFollower:
    """Receives every weight update in its own thread and keeps the snapshots a lagged teacher
    will need (see the module docstring)."""

    def __init__(self, identity: str, rendezvous: "Rendezvous", lag: int, every: int, timeout_s: float,
                 secret: bytes):
        """``identity``: this teacher's member name in the weight group (``teacher-<rank>``);
        ``lag``, ``every``: K and M; ``timeout_s``: of every join and receive; ``secret``: the
        run's (signs the weight group's store)."""
        self.identity, self.rendezvous, self.secret = identity, rendezvous, secret
        self.lag, self.every, self.timeout_s = lag, every, timeout_s
        self.channel = None
        self.epoch = 0  # newest group followed: the channel's, or one that left this teacher out
        self.joins: dict[int, GroupBuild] = {}  # groups forming in the background, by epoch
        self.received: int | None = None  # newest version received whole
        self.updates = self.kept = self.failures = 0
        self._snapshots: dict[int, dict[str, "torch.Tensor"]] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, int, int] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="weight-follower", daemon=True)
        self._thread.start()

    # -- from the scorer's loop -------------------------------------------------------------
    def regroup(self, epoch: int) -> None:
        """The trainer built weight group ``epoch``: start joining it (if it lists this teacher)."""
        self._queue.put(("regroup", epoch, 0))

    def update(self, version: int, epoch: int = 0) -> None:
        """The trainer announced ``version`` into group ``epoch`` (0: the group in use); its
        broadcast follows."""
        self._queue.put(("update", version, epoch))

    def take(self, version: int) -> dict[str, "torch.Tensor"] | None:
        """The snapshot of ``version`` (HF names -> CPU tensors), given up by the follower, or
        None if it was never received; snapshots older than ``version`` are dropped."""
        with self._lock:
            snap = self._snapshots.pop(version, None)
            for old in [v for v in self._snapshots if v < version]:
                del self._snapshots[old]
        return snap

    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._snapshots)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(self.timeout_s)
        for build in self.joins.values():
            build.abandon()
        self._close_channel()

    # -- the follower's thread --------------------------------------------------------------
    def _run(self) -> None:
        from pipeline.weights.group import WeightSyncError

        while (item := self._queue.get()) is not None:
            kind, value, epoch = item
            try:
                if kind == "regroup":
                    self._join(value)
                else:
                    self._follow(value, epoch or max([self.epoch, *self.joins]))  # 0: the newest group joined
            except (WeightSyncError, TimeoutError) as exc:  # the trainer regroups; wait for it
                self.failures += 1
                self._close_channel()
                log.error("weight %s %d failed (%s); waiting for the trainer's next group", kind, value, exc)

    def _follow(self, version: int, epoch: int) -> None:
        """``version`` is broadcast into group ``epoch``: switch to it if it is being joined, leave
        the group in use if the trainer's group is a newer one without this teacher; receive it
        if this teacher is in that group."""
        if epoch in self.joins:
            self._switch(epoch)
        elif epoch > self.epoch:
            self._close_channel()
            self.epoch = epoch
        if self.channel is not None and epoch == self.epoch:
            self._receive(version)

    def _join(self, epoch: int) -> None:
        """Start forming group ``epoch`` in the background (older joins go on until a switch)."""
        from pipeline.weights.group import TorchDistChannel

        if epoch <= max([self.epoch, *self.joins]) or self.rendezvous.get(f"weights-{epoch + 1}") is not None:
            return  # old news, or a group the trainer gave up already (its successor's regroup follows)
        w = self.rendezvous.wait(f"weights-{epoch}", self.timeout_s)
        me = w["ranks"].get(self.identity)
        if me is None:
            log.info("weight group epoch %d does not list %s", epoch, self.identity)
            return
        device = _current_gpu() if w["backend"] == "nccl" else None  # read here, not on the build's thread
        self.joins[epoch] = GroupBuild(epoch, None, lambda: TorchDistChannel(
            w["host"], w["port"], me, w["world_size"], self.timeout_s, w["backend"], epoch, w.get("senders", 1),
            device, secret=self.secret))
        log.info("joining weight group epoch %d as rank %d of %d", epoch, me, w["world_size"])

    def _switch(self, epoch: int) -> None:
        """Use group ``epoch`` from now on (an update was announced into it): waits for it to form;
        joins of older groups are given up."""
        self._close_channel()
        self.epoch = epoch
        self.channel, build = take_joined(self.joins, epoch, self.timeout_s + 5)
        log.info("switched to weight group epoch %d (formed in %.3fs)", epoch, build.built_s)

    def _receive(self, announced: int) -> None:
        update = self.channel.receive(stage=False)
        v = update.version
        if v != announced:
            log.warning("announced version %d, received %d", announced, v)
        with self._lock:
            # a request sent before v was reported (policy at v - 1) may still ask for this one
            due = lagged_teacher_version(v - 1, self.lag, self.every)
            keep = v > 0 and v % self.every == 0 and v not in self._snapshots and v >= due  # 0: the initial checkpoint
        snap: dict[str, "torch.Tensor"] = {}
        for name, tensor in update:  # views into the receive buffers: copied before the next bucket
            if keep:
                snap[name] = tensor.detach().to("cpu", copy=True)
        with self._lock:
            if keep:
                self._snapshots[v] = snap
                self.kept += 1
            for old in [u for u in self._snapshots if u < due]:
                del self._snapshots[old]
            self.received = v
            self.updates += 1

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def _current_gpu():
    """This thread's current GPU (the scorer process was confined to its own: pipeline.launch.gpus)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device())
