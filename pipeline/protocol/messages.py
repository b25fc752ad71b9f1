"""The control protocol: one typed record per message kind, shared by both ends.

Every message between the orchestrator and the generators or trainer is one of the dataclasses
below. `encode` turns a record into the wire's ``(kind, meta, arrays)`` (`pipeline.protocol.wire`: msgpack
header, raw array frames, GMAC over everything); `decode` turns a received `wire.Message` back into
its record, checking every field's type and every required array frame, or raises `MessageError`
naming the kind and the problem. Nothing past `decode` indexes a metadata dict.

Invariants:
- a kind names exactly one record class (`KINDS`); the record's fields are the header's ``meta``
  (nested records travel as maps), except the field ``arrays``, which travels as raw frames and
  must hold at least the record's ``ARRAYS``;
- `decode` never raises anything but `MessageError`: an unknown kind, a missing, unknown or
  ill-typed field, a value out of range (a record's ``__post_init__`` checks, which also stop a
  sender from building it), a missing frame all become one clear error, which the orchestrator counts
  (``bad_message``) and answers with an `Error` record;
- `encode(decode(m))` reproduces ``m``'s kind, meta and arrays.

Adding a message: declare a frozen dataclass with ``KIND`` (and ``ARRAYS`` when it carries frames)
under `@message`; fields may be ``int``, ``float``, ``str``, ``bool``, ``X | None``, ``list[X]``,
``dict[str, X]`` or another record. The receiving end dispatches on the record's class.

Worked example: ``encode(Want(Credit(free=2, received=5, epoch="ab12", loaded=3)))`` is
``("want", {"credit": {"free": 2, "received": 5, "epoch": "ab12", "loaded": 3}}, None)``; a
``want`` whose ``free`` is ``"2"`` decodes to ``MessageError("want: credit.free: expected int,
got str")``.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import numpy as np

from pipeline.protocol.wire import Message

KINDS: dict[str, type] = {}
"""Message kind -> its record class."""


class MessageError(ValueError):
    """A received message is not a well-formed record of a known kind."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


def message(cls: type) -> type:
    """Register a record class under its ``KIND``."""
    if cls.KIND in KINDS:
        raise ValueError(f"message kind {cls.KIND!r} defined twice")
    KINDS[cls.KIND] = cls
    return cls


def _arrays() -> dict[str, np.ndarray]:
    return field(default_factory=dict, repr=False)


def _at_least(record: Any, low: int, *names: str) -> None:
    """Value checks of a record (run when it is built, on either end): `ValueError` naming the field."""
    for name in names:
        value = getattr(record, name)
        if value is not None and value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


# -- generator -> orchestrator ------------------------------------------------------------------
@dataclass(frozen=True)
class Credit:
    """Absolute, idempotent credit (see `pipeline.protocol.links`)."""
    free: int
    """Free slots (groups the generator can take now)."""
    received: int
    """Work items received from the orchestrator epoch ``epoch``."""
    epoch: str | None
    """The orchestrator epoch ``received`` counts in (None: none yet)."""
    loaded: int | None
    """Weights version the generator holds (None: it does not say)."""

    def __post_init__(self) -> None:
        _at_least(self, 0, "free", "received", "loaded")


@message
@dataclass(frozen=True)
class Hello:
    KIND: ClassVar[str] = "hello"
    generator_id: int
    job: str = ""
    """The generator job it belongs to (``genjob-<k>``; "": the run's own job), for the metrics."""


@message
@dataclass(frozen=True)
class Leave:
    """A planned departure (stop signal: scancel, time limit): the generator gave up its in-flight
    groups (``returned``), takes no more work and exits once the orchestrator answers `Stop`."""
    KIND: ClassVar[str] = "leave"
    generator_id: int
    returned: int

    def __post_init__(self) -> None:
        _at_least(self, 0, "returned")


@message
@dataclass(frozen=True)
class Want:
    KIND: ClassVar[str] = "want"
    credit: Credit


@message
@dataclass(frozen=True)
class Result:
    """A generated group; ``arrays`` are its SampleBatch columns."""
    KIND: ClassVar[str] = "result"
    group_id: int
    attempt: int
    credit: Credit | None = None
    """The freed slot travels with the result (None on a re-send)."""
    arrays: dict[str, np.ndarray] = _arrays()

    def __post_init__(self) -> None:
        _at_least(self, 0, "group_id", "attempt")


@message
@dataclass(frozen=True)
class EvalResult:
    """Answers of an evaluation round; ``arrays``: SampleBatch columns plus ``eval_index``."""
    KIND: ClassVar[str] = "eval_result"
    ARRAYS: ClassVar[tuple[str, ...]] = ("eval_index",)
    step: int
    arrays: dict[str, np.ndarray] = _arrays()

    def __post_init__(self) -> None:
        _at_least(self, 0, "step")


# -- orchestrator -> generator ------------------------------------------------------------------
@message
@dataclass(frozen=True)
class Work:
    """Groups to generate: ``items`` are [group_id, attempt, prompt_id, n] per group; ``arrays``
    ``prompt_ids`` (flat) and ``prompt_len``."""
    KIND: ClassVar[str] = "work"
    ARRAYS: ClassVar[tuple[str, ...]] = ("prompt_ids", "prompt_len")
    epoch: str
    version: int
    items: list[list[int]]
    arrays: dict[str, np.ndarray] = _arrays()

    def __post_init__(self) -> None:
        _at_least(self, 0, "version")
        if any(len(item) != 4 or min(item) < 0 for item in self.items):
            raise ValueError("items must be [group_id, attempt, prompt_id, n] of non-negative ints")


@message
@dataclass(frozen=True)
class Ack:
    """Resolved results: [group_id, attempt, outcome] per group."""
    KIND: ClassVar[str] = "ack"
    groups: list[list[Union[int, str]]]

    def __post_init__(self) -> None:
        if any(len(g) != 3 or not isinstance(g[2], str) for g in self.groups):
            raise ValueError("groups must be [group_id, attempt, outcome]")


@message
@dataclass(frozen=True)
class EvalWork:
    KIND: ClassVar[str] = "eval_work"
    ARRAYS: ClassVar[tuple[str, ...]] = ("prompt_ids", "prompt_len")
    step: int
    indices: list[int]
    arrays: dict[str, np.ndarray] = _arrays()


@message
@dataclass(frozen=True)
class Update:
    """Join the broadcast of weights ``version`` and load them."""
    KIND: ClassVar[str] = "update"
    version: int
    epoch: int = 0
    """The weight group the broadcast goes into (0: not told)."""

    def __post_init__(self) -> None:
        _at_least(self, 0, "version")


@message
@dataclass(frozen=True)
class Stop:
    """No more work will come: finish and exit (also the answer to `Leave`, once the trainer has
    listed the members without the leaver: no broadcast waits for it any more)."""
    KIND: ClassVar[str] = "stop"


# -- trainer <-> orchestrator -------------------------------------------------------------------
@message
@dataclass(frozen=True)
class GetBatch:
    KIND: ClassVar[str] = "get_batch"
    step: int
    version: int
    """Version loaded by every generator, as the trainer knows it."""
    dp_size: int
    dp_rank: int | None = None
    """Only this data-parallel rank's share (None: the whole batch)."""

    def __post_init__(self) -> None:
        _at_least(self, 0, "step", "version", "dp_rank")
        _at_least(self, 1, "dp_size")
        if self.dp_rank is not None and self.dp_rank >= self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} is not below dp_size {self.dp_size}")


@message
@dataclass(frozen=True)
class Batch:
    """Step ``step``'s samples (``dp_rank``'s share, None: all); ``arrays``: SampleBatch columns
    plus ``dp_rank`` of each sample."""
    KIND: ClassVar[str] = "batch"
    ARRAYS: ClassVar[tuple[str, ...]] = ("dp_rank",)
    step: int
    dp_rank: int | None
    """The share asked for (a late reply to an earlier request is told apart by it)."""
    arrays: dict[str, np.ndarray] = _arrays()


@message
@dataclass(frozen=True)
class TrainerVersion:
    """The trainer's weights ``version`` is loaded by every generator."""
    KIND: ClassVar[str] = "version"
    version: int

    def __post_init__(self) -> None:
        _at_least(self, 0, "version")


@message
@dataclass(frozen=True)
class Resume:
    """The trainer restarted from the checkpoint taken after ``step`` steps."""
    KIND: ClassVar[str] = "resume"
    step: int

    def __post_init__(self) -> None:
        _at_least(self, 0, "step")


@message
@dataclass(frozen=True)
class EvalRequest:
    KIND: ClassVar[str] = "eval_request"
    step: int
    version: int

    def __post_init__(self) -> None:
        _at_least(self, 0, "step", "version")


@message
@dataclass(frozen=True)
class WeightsAnnounced:
    """The trainer is about to broadcast weights ``version``."""
    KIND: ClassVar[str] = "weights"
    version: int
    epoch: int = 0
    """The weight group it broadcasts into (0: not told)."""

    def __post_init__(self) -> None:
        _at_least(self, 0, "version")


@message
@dataclass(frozen=True)
class ListMembers:
    """Which generators are alive? (answered by `Members`)"""
    KIND: ClassVar[str] = "list_members"


@message
@dataclass(frozen=True)
class Members:
    KIND: ClassVar[str] = "members"
    members: dict[str, int]
    """Alive generators: identity -> incarnation."""


@message
@dataclass(frozen=True)
class Regroup:
    """A new weight group at ``epoch`` (trainer -> orchestrator -> every generator)."""
    KIND: ClassVar[str] = "regroup"
    epoch: int

    def __post_init__(self) -> None:
        _at_least(self, 0, "epoch")


@message
@dataclass(frozen=True)
class Finish:
    """The run is over: stop the generators, then exit."""
    KIND: ClassVar[str] = "finish"


@message
@dataclass(frozen=True)
class Error:
    """The answer to a message that could not be taken: its kind and why."""
    KIND: ClassVar[str] = "error"
    kind: str
    detail: str


# -- codec --------------------------------------------------------------------------------------
def encode(msg: Any) -> tuple[str, dict, dict[str, np.ndarray] | None]:
    """``(kind, meta, arrays)`` for `MessageServer.send` / `MessageClient.send`."""
    meta = {f.name: _plain(getattr(msg, f.name)) for f in dataclasses.fields(msg) if f.name != "arrays"}
    arrays = getattr(msg, "arrays", None)
    return msg.KIND, meta, (dict(arrays) if arrays else None)


def decode(raw: Message) -> Any:
    """The record of a received message, or `MessageError`."""
    cls = KINDS.get(raw.kind)
    if cls is None:
        raise MessageError(raw.kind, "unknown message kind")
    try:
        values = _record(cls, raw.meta, "")
        if any(f.name == "arrays" for f in dataclasses.fields(cls)):
            missing = [a for a in getattr(cls, "ARRAYS", ()) if a not in raw.arrays]
            if missing:
                raise _Bad(f"missing array frame(s) {', '.join(missing)}")
            values["arrays"] = raw.arrays
        elif raw.arrays:
            raise _Bad("carries array frames it does not define")
        return cls(**values)
    except (_Bad, ValueError) as exc:  # ValueError: a record's own value checks
        raise MessageError(raw.kind, str(exc)) from None


class _Bad(Exception):
    pass


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _record(cls: type, meta: Any, where: str) -> dict:
    if not isinstance(meta, dict):
        raise _Bad(f"{where or 'meta'}: expected a map, got {type(meta).__name__}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "arrays"}
    extra = set(meta) - set(fields)
    if extra:
        raise _Bad(f"unknown field(s) {', '.join(sorted(map(str, extra)))}")
    out = {}
    for name, f in fields.items():
        if name not in meta:
            if f.default is dataclasses.MISSING:
                raise _Bad(f"missing field {where}{name}")
            continue
        out[name] = _check(hints[name], meta[name], f"{where}{name}")
    return out


def _check(tp: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        for arm in args:
            try:
                return _check(arm, value, where)
            except _Bad:
                continue
        raise _Bad(f"{where}: expected {_name(tp)}, got {type(value).__name__}")
    if tp is type(None):
        if value is None:
            return None
    elif dataclasses.is_dataclass(tp):
        return tp(**_record(tp, value, where + "."))
    elif origin is list and isinstance(value, list):
        return [_check(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    elif origin is dict and isinstance(value, dict):
        return {_check(args[0], k, where): _check(args[1], v, f"{where}[{k!r}]") for k, v in value.items()}
    elif tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif tp in (str, bool) and type(value) is tp:
        return value
    raise _Bad(f"{where}: expected {_name(tp)}, got {type(value).__name__}")


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]
