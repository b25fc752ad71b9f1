"""The policy clock: the one owner of every version fact the orchestrator knows, and the one
staleness predicate (see `docs/architecture.md`, "Staleness, admission and the policy clock").

Versions: version v names the weights after v optimizer steps; the trainer's *step* is the step it
asks a batch for (= versions it has produced). The clock changes only by events, one method each:

- `weights_announced(v)`  the trainer is about to broadcast v (generators that join later load it);
- `generator_joined(p)`   a (re)started generator said hello: it holds no weights yet;
- `generator_loaded(p, v)` generator p reports holding v (with every credit update);
- `generator_lost(p)`     p went silent or was replaced;
- `trainer_reported(v)`   every generator of the weight group has loaded v;
- `trainer_at_step(s, v)` the trainer asks for step s's batch, with v loaded everywhere;
- `trainer_resumed(k)`    the trainer restarted from the checkpoint after k steps: a rollback.

Invariants:
- ``admission_version`` (what the admission bound is computed from) is at most the version the
  trainer reported and at most every live generator's loaded version; it is None (admission shut)
  until the trainer has reported, and while a live generator still holds weights a rollback
  discarded (it reported a version above the rollback point and has not since reported one at or
  below it);
- ``trainer_step`` only grows, except at a rollback, which sets it to k;
- after a rollback to k, version numbers above k name weights that no longer exist and will be
  reused for different weights. ``rollback_epoch`` counts rollbacks (in this orchestrator incarnation); a
  group is *rolled back* when it was generated under an earlier epoch and holds a token of a
  version above the lowest rollback point since then (`rolled_back`). Such groups are dropped
  under their own outcome (``DROPPED_ROLLBACK``), not kept as off-policy data: the record carries
  version numbers only, so their staleness against the resumed policy cannot be stated honestly
  (they come from a branch of training that was discarded, not from an older point of this one);
- one staleness predicate (`is_stale`) serves scoring, the buffer and the step batches, and
  `staleness` is the number the trainer reports.

Worked example (max_staleness 1): the trainer reports 0, generators load 0: admission_version 0.
Steps 0..5 run; generator loads 6, trainer reports 6, trainer_step 6. A group with min_version 4
is stale (6 - 4 = 2 > 1), one with min 5 is not. The trainer is killed and resumes from the
checkpoint after 4 steps: trainer_resumed(4) -> trainer_step 4, reported min(6, 4) = 4, rollback
epoch 1, rollback point 4; the generator still reports 6 (old weights), so admission_version is None
until it reports 4. A group leased in rollback epoch 0 holding tokens of version 5 is rolled back
(5 > 4); one whose tokens are all <= 4 is kept. When the new version 5 arrives, groups leased in
rollback epoch 1 with
version-5 tokens are of the new weights and kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

UNKNOWN_ROLLBACK_EPOCH = -1
"""The rollback epoch of work leased before this orchestrator incarnation (before every rollback
this incarnation has seen)."""


def staleness(trainer_step: int, min_version):
    """How many versions the oldest token is behind the step being trained (array or int)."""
    return trainer_step - min_version


def is_stale(trainer_step: int, min_version, max_staleness: int):
    """The staleness predicate: a group (or batch rows) too old to train step ``trainer_step``."""
    return staleness(trainer_step, min_version) > max_staleness


@dataclass
class GeneratorVersion:
    loaded: int | None = None
    """Version it reports holding (None: it does not say)."""
    confirmed_rollback_epoch: int = 0
    """Latest rollback epoch whose weights it is known to hold (a report <= the rollback point)."""


@dataclass
class PolicyClock:
    max_staleness: int
    reported: int | None = None
    """Version the trainer reports as loaded by every generator (None until it speaks)."""
    announced: int | None = None
    """Version the trainer last announced for broadcast (None: none, or rolled back)."""
    trainer_step: int = 0
    """Optimizer steps the trainer has done (the step it asks a batch for)."""
    rollback_epoch: int = 0
    """Rollbacks seen by this incarnation."""
    rollback_points: list[int] = field(default_factory=list)
    """The checkpoint step k of each rollback, in order (epoch e started with rollback_points[e-1])."""
    generators: dict[bytes, GeneratorVersion] = field(default_factory=dict)

    # -- events ---------------------------------------------------------------------------------
    def weights_announced(self, version: int) -> None:
        self.announced = version

    def generator_joined(self, peer: bytes) -> None:
        self.generators[peer] = GeneratorVersion(None, self.rollback_epoch)

    def generator_loaded(self, peer: bytes, version: int | None) -> None:
        g = self.generators.setdefault(peer, GeneratorVersion(None, self.rollback_epoch))
        g.loaded = version
        if (version is not None and g.confirmed_rollback_epoch < self.rollback_epoch
                and version <= self.rollback_points[-1]):
            g.confirmed_rollback_epoch = self.rollback_epoch

    def generator_lost(self, peer: bytes) -> None:
        self.generators.pop(peer, None)

    def trainer_reported(self, version: int) -> None:
        self.reported = version

    def trainer_at_step(self, step: int, version: int) -> None:
        self.reported = version
        self.trainer_step = max(self.trainer_step, step)

    def trainer_resumed(self, k: int) -> None:
        """Rollback to the checkpoint after ``k`` steps (a resume at the current step included:
        in-flight work may hold versions the lost trainer produced after its checkpoint)."""
        self.rollback_epoch += 1
        self.rollback_points.append(k)
        for g in self.generators.values():  # those holding versions above k hold discarded weights
            if g.confirmed_rollback_epoch == self.rollback_epoch - 1 and (g.loaded is None or g.loaded <= k):
                g.confirmed_rollback_epoch = self.rollback_epoch
        self.trainer_step = k
        if self.reported is not None:  # else admission opens once the trainer pushed weights
            self.reported = min(self.reported, k)
        if self.announced is not None and self.announced > k:
            self.announced = None

    # -- facts ----------------------------------------------------------------------------------
    @property
    def admission_version(self) -> int | None:
        """The version every live generator holds and the trainer reported (None: shut)."""
        if self.reported is None:
            return None
        versions = []
        for g in self.generators.values():
            if g.confirmed_rollback_epoch < self.rollback_epoch:
                return None  # still holds weights of before the rollback
            if g.loaded is not None:
                versions.append(g.loaded)
        return min([self.reported, *versions])

    def is_stale(self, min_version) -> bool:
        return is_stale(self.trainer_step, min_version, self.max_staleness)

    def rollback_floor(self, since_epoch: int) -> int | None:
        """The lowest rollback point after ``since_epoch`` (None: no rollback since)."""
        later = self.rollback_points[max(0, since_epoch):]
        return min(later) if later else None

    def rolled_back(self, since_epoch: int, versions: np.ndarray) -> bool:
        """Whether work generated from epoch ``since_epoch`` on holds a token of discarded weights."""
        floor = self.rollback_floor(since_epoch)
        return floor is not None and len(versions) > 0 and int(np.max(versions)) > floor
