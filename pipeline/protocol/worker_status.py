"""The engine worker's answer to the driver's ``received`` poll (`pipeline.generator.weight_receive`
-> `pipeline.generator.engine`), one record on channel ``WORKER_STATUS``.

The worker returns `encode`'s ``(kind, meta)`` (plain values through vLLM's collective RPC); the
driver decodes it with `received_state`, which raises `MessageError` on anything else.

Invariants: ``state`` is "pending" (still receiving), "ok" (``version`` received; ``prepared``:
its kernel form is built, so the pause only swaps) or "failed" (``error``; the update was dropped
and the loaded weights are untouched).

Worked example: a worker that staged version 4 in kernel form answers
``("received", {"state": "ok", "version": 4, "prepared": True, "error": ""})``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.protocol.codec import Channel, MessageError, encode
from pipeline.protocol.wire import Message

WORKER_STATUS = Channel("engine worker status")
RECEIVE_STATES = ("pending", "ok", "failed")


@WORKER_STATUS.message
@dataclass(frozen=True)
class Received:
    KIND: ClassVar[str] = "received"
    state: str
    version: int | None = None
    """The version received (state "ok")."""
    prepared: bool = False
    """Its kernel form is built (state "ok"; False: the pause loads it in place)."""
    error: str = ""
    """Why it failed (state "failed")."""

    def __post_init__(self) -> None:
        if self.state not in RECEIVE_STATES:
            raise ValueError(f"state must be one of {', '.join(RECEIVE_STATES)}, got {self.state!r}")
        if self.state == "ok" and self.version is None:
            raise ValueError("an ok state names the version received")

    def plain(self) -> tuple[str, dict]:
        """What the worker returns to the driver."""
        kind, meta, _ = encode(self)
        return kind, meta


def received_state(answer: tuple[str, dict] | list) -> Received:
    """A worker's `Received.plain` answer as its record (`MessageError` if it is not one)."""
    if not isinstance(answer, (tuple, list)) or len(answer) != 2 or not isinstance(answer[0], str):
        raise MessageError("?", f"a worker status is a (kind, meta) pair, got {answer!r:.200}")
    kind, meta = answer
    return WORKER_STATUS.decode(Message(kind, meta))
