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
- credits are absolute and idempotent (see `pipeline.protocol.links`): a generator is granted
  ``free - (granted_this_incarnation - received)`` groups, never more.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pipeline.protocol.messages import Credit


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
        self._incarnations = 0

    def hello(self, peer: bytes) -> bool:
        """Register a (re)started generator; True if it replaces an earlier incarnation."""
        restarted = peer in self.gens
        self.leaving.discard(peer)
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
