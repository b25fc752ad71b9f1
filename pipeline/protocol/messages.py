"""The control protocol: one typed record per message kind, shared by both ends.

Every message between the orchestrator and the generators or trainer is one of the dataclasses
below. `encode` turns a record into the wire's ``(kind, meta, arrays)`` (`pipeline.protocol.wire`: msgpack
header, raw array frames, GMAC over everything); `decode` turns a received `wire.Message` back into
its record, checking every field's type and every required array frame, or raises `MessageError`
naming the kind and the problem (the codec: `pipeline.protocol.codec`, this module's channel
``ORCHESTRATOR``). Nothing past `decode` indexes a metadata dict.

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
under `@message`; field types as `pipeline.protocol.codec` lists. The receiving end dispatches on the record's class.

Worked example: ``encode(Want(Credit(free=2, received=5, incarnation="ab12", loaded=3)))`` is
``("want", {"credit": {"free": 2, "received": 5, "incarnation": "ab12", "loaded": 3}}, None)``; a
``want`` whose ``free`` is ``"2"`` decodes to ``MessageError("want: credit.free: expected int,
got str")``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Union

import numpy as np

# MessageError and encode are this channel's codec for its users (`m.encode`, `m.MessageError`).
from pipeline.protocol.codec import Channel, MessageError, arrays_field, at_least, encode, version_fields  # noqa: F401

ORCHESTRATOR = Channel("orchestrator")
"""The orchestrator's control plane (generators and trainer on one side, the orchestrator on the other)."""
KINDS = ORCHESTRATOR.kinds
"""Message kind -> its record class."""
message = ORCHESTRATOR.message
decode = ORCHESTRATOR.decode


# -- generator -> orchestrator ------------------------------------------------------------------
@dataclass(frozen=True)
class Credit:
    """Absolute, idempotent credit (see `pipeline.protocol.links`)."""
    free: int
    """Free slots (groups the generator can take now)."""
    received: int
    """Work items received from the orchestrator incarnation ``incarnation``."""
    incarnation: str | None
    """The orchestrator incarnation ``received`` counts in (None: none yet)."""
    loaded: int | None
    """Weights version the generator holds (None: it does not say)."""

    def __post_init__(self) -> None:
        at_least(self, 0, "free", "received")
        version_fields(self, "loaded")


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
        at_least(self, 0, "returned")


@message
@dataclass(frozen=True)
class StartProgress:
    """A starting generator's heartbeat, sent each second before its `Hello` (its engine starts):
    the phase it is in and the CPU seconds its engine's process tree has used so far
    (`pipeline.generator.start_report`). The orchestrator counts it as progress while the CPU
    seconds grow or the phase changes (`pipeline.orchestrator.members`)."""
    KIND: ClassVar[str] = "start_progress"
    generator_id: int
    phase: str
    """``starting`` (before the engine's processes exist), ``engine``, ``warm-up``."""
    cpu_s: float
    """CPU seconds (user + system) of the engine's process tree (of the generator process itself
    while no engine process exists)."""

    def __post_init__(self) -> None:
        at_least(self, 0, "generator_id", "cpu_s")


@message
@dataclass(frozen=True)
class Want:
    KIND: ClassVar[str] = "want"
    credit: Credit


@message
@dataclass(frozen=True)
class Result:
    """Generated groups, one or more; ``arrays`` are their samples' SampleBatch columns, ordered by
    group as ``groups`` lists them, each group's samples contiguous (the orchestrator cuts them at
    every ``group_size`` samples; a group whose ``group_id``/``attempt`` columns differ from its
    pair here is refused as invalid). At most ``orchestrator.transport.max_groups_per_result``
    groups: the generator packs no more, the orchestrator refuses a message with more."""
    KIND: ClassVar[str] = "result"
    groups: list[list[int]]
    """[group_id, attempt] per group, in the order of their samples; no group id twice."""
    credit: Credit | None = None
    """The freed slots travel with the results (None on a re-send)."""
    arrays: dict[str, np.ndarray] = arrays_field()

    def __post_init__(self) -> None:
        if not self.groups or any(len(g) != 2 or min(g) < 0 for g in self.groups):
            raise ValueError("groups must be one or more [group_id, attempt] of non-negative ints")
        if len({g[0] for g in self.groups}) != len(self.groups):
            raise ValueError("groups names a group id twice")


@message
@dataclass(frozen=True)
class EvalResult:
    """Answers of an evaluation round; ``arrays``: SampleBatch columns plus ``eval_index``."""
    KIND: ClassVar[str] = "eval_result"
    ARRAYS: ClassVar[tuple[str, ...]] = ("eval_index",)
    step: int
    arrays: dict[str, np.ndarray] = arrays_field()

    def __post_init__(self) -> None:
        at_least(self, 0, "step")


# -- orchestrator -> generator ------------------------------------------------------------------
@message
@dataclass(frozen=True)
class Work:
    """Groups to generate: ``items`` are [group_id, attempt, prompt_id, n] per group; ``arrays``
    ``prompt_ids`` (flat) and ``prompt_len``."""
    KIND: ClassVar[str] = "work"
    ARRAYS: ClassVar[tuple[str, ...]] = ("prompt_ids", "prompt_len")
    incarnation: str
    """The orchestrator's incarnation (a new one at each start)."""
    version: int
    items: list[list[int]]
    arrays: dict[str, np.ndarray] = arrays_field()

    def __post_init__(self) -> None:
        version_fields(self, "version")
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
    arrays: dict[str, np.ndarray] = arrays_field()


@message
@dataclass(frozen=True)
class Update:
    """Join the broadcast of weights ``version`` and load them."""
    KIND: ClassVar[str] = "update"
    version: int
    weight_epoch: int = 0
    """The weight group the broadcast goes into (0: not told)."""

    def __post_init__(self) -> None:
        version_fields(self, "version")


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
        at_least(self, 0, "step", "dp_rank")
        version_fields(self, "version")
        at_least(self, 1, "dp_size")
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
    arrays: dict[str, np.ndarray] = arrays_field()


@message
@dataclass(frozen=True)
class TrainerVersion:
    """The trainer's weights ``version`` is loaded by every generator."""
    KIND: ClassVar[str] = "version"
    version: int

    def __post_init__(self) -> None:
        version_fields(self, "version")


@message
@dataclass(frozen=True)
class Resume:
    """The trainer restarted from the checkpoint taken after ``step`` steps."""
    KIND: ClassVar[str] = "resume"
    step: int

    def __post_init__(self) -> None:
        at_least(self, 0, "step")


@message
@dataclass(frozen=True)
class EvalRequest:
    KIND: ClassVar[str] = "eval_request"
    step: int
    version: int

    def __post_init__(self) -> None:
        at_least(self, 0, "step")
        version_fields(self, "version")


@message
@dataclass(frozen=True)
class WeightsAnnounced:
    """The trainer is about to broadcast weights ``version``."""
    KIND: ClassVar[str] = "weights"
    version: int
    weight_epoch: int = 0
    """The weight group it broadcasts into (0: not told)."""

    def __post_init__(self) -> None:
        version_fields(self, "version")


@message
@dataclass(frozen=True)
class ListMembers:
    """Which generators are alive? (answered by `Members`)"""
    KIND: ClassVar[str] = "list_members"


@dataclass(frozen=True)
class StartStatus:
    """A generator whose engine is starting (it sent `StartProgress`, no `Hello` yet)."""
    identity: str
    """Its identity (``gen-<id>``)."""
    phase: str
    """The phase it reported last."""
    cpu_s: float
    """The CPU seconds it reported last."""
    quiet_s: float
    """Seconds since its reports last showed progress (CPU seconds grown, or a new phase)."""


@message
@dataclass(frozen=True)
class Members:
    KIND: ClassVar[str] = "members"
    members: dict[str, int]
    """Alive generators: identity -> incarnation."""
    starting: list[StartStatus] = field(default_factory=list)
    """Generators whose engine is starting, with their progress."""


@message
@dataclass(frozen=True)
class Regroup:
    """A new weight group at weight-group epoch ``weight_epoch`` (trainer -> orchestrator -> every
    generator)."""
    KIND: ClassVar[str] = "regroup"
    weight_epoch: int

    def __post_init__(self) -> None:
        at_least(self, 0, "weight_epoch")


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
