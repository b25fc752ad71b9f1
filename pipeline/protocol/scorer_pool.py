"""The scorer pool's records: the orchestrator's pool (`pipeline.scorers.pool`) and its scorer
processes (`pipeline.scorers.role`), one typed record per kind on the channel ``SCORER_POOL``
(codec: `pipeline.protocol.codec`).

  scorer -> pool   `ScorerHello`, `ScorerAlive` every second, `Scored` (one per `Score`)
  pool -> scorer   `Score`, `ScorerWho` (say hello again), `ScorerStop`
  pool -> teacher  `WeightsRegroup`, `WeightsUpdate` (a lagged teacher that follows the weights)

Invariants:
- `Score` carries the groups' SampleBatch columns as frames and the schema they follow;
  `Scored` carries the filled fields concatenated over the request's groups plus ``group_rows`` /
  ``group_tokens`` (per group, in request order), or ``error`` and no frames;
- ``teacher_version`` is set only for a lagged teacher: in `Score` the snapshot to use, in
  `Scored` the one used.

Worked example: ``encode(Score(request=7, jobs=[3, 4], schema=s, arrays=cols))`` is
``("score", {"request": 7, "jobs": [3, 4], "schema": s, "teacher_version": None}, cols)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from pipeline.protocol.codec import Channel, arrays_field, at_least

SCORER_POOL = Channel("scorer pool")


@SCORER_POOL.message
@dataclass(frozen=True)
class ScorerHello:
    KIND: ClassVar[str] = "scorer_hello"
    service: str
    """"reward" or "teacher"."""
    rank: int = 0
    slots: int = 1
    """Requests it takes at once."""
    follows_weights: bool = False
    """A lagged teacher that receives every weight update."""

    def __post_init__(self) -> None:
        at_least(self, 0, "rank")
        at_least(self, 1, "slots")


@SCORER_POOL.message
@dataclass(frozen=True)
class ScorerAlive:
    KIND: ClassVar[str] = "scorer_alive"


@SCORER_POOL.message
@dataclass(frozen=True)
class Score:
    """Score these groups; ``arrays``: their SampleBatch columns (``schema``'s)."""
    KIND: ClassVar[str] = "score"
    request: int
    jobs: list[int]
    """The pool's job of each group, in order."""
    schema: dict[str, Any]
    """`RecordSchema.to_dict` of the columns sent."""
    teacher_version: int | None = None
    """A lagged teacher's snapshot to use (None: not lagged)."""
    arrays: dict[str, np.ndarray] = arrays_field()

    def __post_init__(self) -> None:
        at_least(self, 0, "request", "teacher_version")


@SCORER_POOL.message
@dataclass(frozen=True)
class Scored:
    """The answer to `Score` ``request``: the filled fields, or ``error``."""
    KIND: ClassVar[str] = "scored"
    request: int
    jobs: list[int]
    error: str | None = None
    teacher_version: int | None = None
    """The snapshot a lagged teacher used."""
    arrays: dict[str, np.ndarray] = arrays_field()


@SCORER_POOL.message
@dataclass(frozen=True)
class ScorerWho:
    """The pool does not know this scorer (it restarted, or dropped it): say hello again."""
    KIND: ClassVar[str] = "scorer_who"


@SCORER_POOL.message
@dataclass(frozen=True)
class ScorerStop:
    """The run is over: leave."""
    KIND: ClassVar[str] = "scorer_stop"


@SCORER_POOL.message
@dataclass(frozen=True)
class WeightsRegroup:
    """The trainer built the weight group of weight-group epoch ``weight_epoch``."""
    KIND: ClassVar[str] = "weights_regroup"
    weight_epoch: int

    def __post_init__(self) -> None:
        at_least(self, 0, "weight_epoch")


@SCORER_POOL.message
@dataclass(frozen=True)
class WeightsUpdate:
    """The trainer is about to broadcast ``version`` into the weight group of ``weight_epoch``."""
    KIND: ClassVar[str] = "weights_update"
    version: int
    weight_epoch: int = 0

    def __post_init__(self) -> None:
        at_least(self, 0, "version", "weight_epoch")
