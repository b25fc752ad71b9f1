"""The generators the orchestrator knows: credits, liveness and incarnations.

Invariants:
- a generator is *alive* while it has sent anything within ``dead_after_s``; it sends a credit
  update at least every second, so silence means it died or hangs;
- each ``hello`` from a peer starts a new incarnation of it: a restarted generator (same identity,
  new process) is told apart from the one that died, so the trainer rebuilds the weight group;
- a generator that announced its departure (``leave``) is no member from that moment: it is
  forgotten at once (as a dead one is after ``dead_after_s``) and, until the trainer has listed the
  members without it, kept among the *leaving*, who still hear weight-group changes and updates
  (a broadcast the trainer started before it knew must not wait for a missing member), never
  re-adopted by a credit update;
- a generator whose engine starts (`StartProgress` before its ``hello``) is *starting* until its
  ``hello``; its progress is a report whose CPU seconds grew by at least `PROGRESS_CPU_S` since the
  last progress, or whose phase differs (a restarted process's smaller CPU seconds are a new phase
  too); ``quiet_s`` counts from the last progress. Example: reports (engine, 3.0), (engine, 3.1),
  (engine, 3.25) at t = 0, 1, 2 s: progress at 0 and 2 (3.25 - 3.0 >= 0.2), quiet_s 0 at t = 2;
- credits are absolute and idempotent (see `pipeline.protocol.links`): a generator is granted
  ``free - (granted_this_incarnation - received)`` groups, never more.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pipeline.protocol.messages import Credit, StartProgress, StartStatus

PROGRESS_CPU_S = 0.2
"""CPU seconds an engine's process tree must use since the last progress to count as progress again
(a stopped tree uses none; the reporting itself is not counted, `pipeline.generator.start_report`)."""


@dataclass
class StartState:
    phase: str
    cpu_s: float  # at the last progress
    last_cpu_s: float  # reported last
    progressed: float = field(default_factory=time.monotonic)


@dataclass
class GeneratorState:
    incarnation: int
    granted: int = 0
    credit: int = 0
    last_seen: float = field(default_factory=time.monotonic)


class GeneratorPool:
    def __init__(self, dead_after_s: float):
        self.dead_after_s = dead_after_s
        self.gens: dict[bytes, GeneratorState] = {}
        self.leaving: set[bytes] = set()
        self.starting: dict[bytes, StartState] = {}
        self._incarnations = 0

    def start_progress(self, peer: bytes, report: StartProgress) -> None:
        """A starting generator's report (``peer``: the identity it will say ``hello`` with)."""
        s = self.starting.get(peer)
        if s is None or s.phase != report.phase or report.cpu_s < s.last_cpu_s \
                or report.cpu_s - s.cpu_s >= PROGRESS_CPU_S:
            self.starting[peer] = StartState(report.phase, report.cpu_s, report.cpu_s)
        else:
            s.last_cpu_s = report.cpu_s

    def starts(self) -> list[StartStatus]:
        """The starting generators and their progress."""
        now = time.monotonic()
        return [StartStatus(p.decode(errors="replace"), s.phase, s.last_cpu_s, now - s.progressed)
                for p, s in sorted(self.starting.items())]

    def hello(self, peer: bytes) -> bool:
        """Register a (re)started generator; True if it replaces an earlier incarnation."""
        restarted = peer in self.gens
        self.leaving.discard(peer)
        self.starting.pop(peer, None)
        self._incarnations += 1
        self.gens[peer] = GeneratorState(self._incarnations)
        return restarted

    def leave(self, peer: bytes) -> bool:
        """A planned departure: the peer is no member from now on, but leaving until `released`;
        True if it was a member."""
        self.leaving.add(peer)
        return self.gens.pop(peer, None) is not None

    def released(self) -> set[bytes]:
        """The leaving generators, forgotten (call once the trainer has a member list without them)."""
        out, self.leaving = self.leaving, set()
        return out

    def listeners(self) -> list[bytes]:
        """Who hears weight-group changes and updates: members and the leaving."""
        return [*self.gens, *(p for p in self.leaving if p not in self.gens)]

    def seen(self, peer: bytes) -> None:
        g = self.gens.get(peer)
        if g is not None:
            g.last_seen = time.monotonic()

    def set_credit(self, peer: bytes, credit: Credit, incarnation: str) -> None:
        """Apply a credit update (the version it reports loaded is a fact of the policy clock)."""
        if peer in self.leaving:
            return  # it said it leaves: a late credit update must not make it a member again
        g = self.gens.get(peer)
        if g is None:  # a generator from before an orchestrator restart: adopt it
            g = self.gens[peer] = GeneratorState(self._next())
        received = credit.received if credit.incarnation == incarnation else 0
        g.credit = max(0, credit.free - (g.granted - received))

    def _next(self) -> int:
        self._incarnations += 1
        return self._incarnations

    def reap(self) -> list[bytes]:
        """Forget generators silent for ``dead_after_s``; returns them."""
        now = time.monotonic()
        dead = [p for p, g in self.gens.items() if now - g.last_seen > self.dead_after_s]
        for p in dead:
            del self.gens[p]
        return dead

    def members(self) -> dict[str, int]:
        """Alive generators: identity -> incarnation."""
        return {p.decode(errors="replace"): g.incarnation for p, g in self.gens.items()}

    def __iter__(self):
        return iter(self.gens)

    def __len__(self) -> int:
        return len(self.gens)

    def items(self):
        return self.gens.items()
