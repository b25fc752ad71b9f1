"""A weight channel opened on a background thread: a new weight group formed while the old one serves.

Forming a group (`TorchDistChannel`'s constructor) waits until every member has connected; the
trainer and each generator worker start that wait here and go on using the group they are in.
The trainer switches to the new group at a version boundary, once it has formed
(`pipeline.roles.weight_push`); a generator switches when the trainer's first broadcast into it is
announced (`pipeline.roles.weight_take`).

Invariants:
- the opening thread ends within the channel's own timeout (the constructor's), so `wait` with a
  longer timeout either returns the channel or raises `WeightSyncError`;
- a build given up (`abandon`) never leaks its channel: closed at once if already open, else by
  the thread when the constructor returns;
- one build, one channel: `wait` hands it out once (the caller owns and closes it from then on).

Example: the trainer is in group 3 with generator 0 when generator 1 says Hello; it starts the
build of group 4 {0, 1} and keeps broadcasting into group 3 (generator 0 also starts joining 4);
at the first push after group 4 formed it closes 3 and broadcasts into 4.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from pipeline.weights.group import WeightSyncError


class GroupBuild:
    """Opens one weight channel (``open_channel()``) on a daemon thread."""

    def __init__(self, epoch: int, members: Any, open_channel: Callable[[], Any]) -> None:
        self.epoch, self.members = epoch, members
        self.started = time.monotonic()
        self.built_s: float | None = None  # seconds the group took to form (None: not formed)
        self._lock = threading.Lock()
        self._channel: Any = None
        self._error: BaseException | None = None
        self._abandoned = self._taken = False
        self._thread = threading.Thread(target=self._open, args=(open_channel,), daemon=True,
                                        name=f"tokenflow-weight-group-{epoch}")
        self._thread.start()

    def _open(self, open_channel: Callable[[], Any]) -> None:
        try:
            channel = open_channel()
        except BaseException as e:  # handed to `wait`
            self._error = e
            return
        with self._lock:
            self.built_s = time.monotonic() - self.started
            if self._abandoned:
                channel.close()
            else:
                self._channel = channel

    def ready(self, within_s: float = 0.0) -> bool:
        """True once the thread ended (formed or failed); waits for that up to ``within_s``."""
        if within_s > 0:
            self._thread.join(within_s)
        return not self._thread.is_alive()

    def wait(self, timeout_s: float) -> Any:
        """The formed channel (the caller owns it now); `WeightSyncError` if it failed or took longer."""
        self._thread.join(timeout_s)
        with self._lock:
            if self._taken or self._abandoned:
                raise WeightSyncError(f"weight group epoch {self.epoch} was handed out or abandoned already")
            if self._thread.is_alive():
                raise WeightSyncError(f"weight group epoch {self.epoch} did not form within {timeout_s:.0f} s")
            if self._error is not None:
                raise WeightSyncError(f"weight group epoch {self.epoch} failed to form: {self._error}") from self._error
            self._taken = True
            return self._channel

    def abandon(self) -> None:
        """Give the build up: its channel is closed (now, or when it forms)."""
        with self._lock:
            self._abandoned = True
            channel, self._channel = (None if self._taken else self._channel), None
        if channel is not None:
            channel.close()


def take_joined(joins: dict[int, GroupBuild], epoch: int, timeout_s: float) -> tuple[Any, GroupBuild]:
    """Switch to group ``epoch`` among a member's background ``joins`` (by epoch): its build is taken
    out and its formed channel returned with it (waits at most ``timeout_s``, else
    `WeightSyncError`); joins of older groups are given up, newer ones go on."""
    build = joins.pop(epoch)
    for older in [e for e in joins if e < epoch]:
        joins.pop(older).abandon()
    return build.wait(timeout_s), build
