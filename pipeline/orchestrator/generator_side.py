"""The orchestrator's generator side: membership, credit and work grants.

`GeneratorSide` is a part of `pipeline.orchestrator.service.Orchestrator` (its only user), kept in
a module of its own: the handlers of the messages generators send about themselves (`Hello`,
`Leave`, `Want`, `StartProgress`), the trainer's membership questions (`ListMembers`, `Regroup`)
and the grants of work. It runs on the orchestrator's single event loop and uses its state
(admission, clock, generator pool, prompts, server).

Invariants it keeps (with the service's):
- work is granted one group at a time to each generator with credit in turn, so none is
  starved, as one `Work` message per generator and grant; a grant happens in a turn once a
  generator has `GRANT_MIN` free slots (its credit, carried by its results) or the flush window
  ends (`Orchestrator.turn`): a few groups per `Work` message, not one per result, and no
  generator waits a whole window with half its slots idle;
- a generator silent for ``generator_dead_after_s`` is lost: its leases are re-issued;
- a planned leave returns the leaver's leases at once; it hears `Stop` once the trainer has
  listed the members without it.

Example: two generators with 8 free slots each and 30 groups of capacity: one grant sends each
an 8-group `Work` (16 leases), alternating between them; when 3 results of the first arrive in a
turn it waits (3 free slots), at the fourth it gets a 4-group `Work`.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pipeline.protocol import messages as m
from pipeline.protocol.links import prompt_arrays

if TYPE_CHECKING:
    from collections import Counter

    from pipeline.metrics import MetricsWriter
    from pipeline.orchestrator.admission import Admission
    from pipeline.orchestrator.clock import PolicyClock
    from pipeline.orchestrator.config import OrchestratorConfig
    from pipeline.orchestrator.members import GeneratorPool
    from pipeline.orchestrator.prompts import PromptSource
    from pipeline.orchestrator.scoring import Scoring

log = logging.getLogger("pipeline.orchestrator.service")

GRANT_MIN = 4
"""Free slots of one generator that make a turn grant work before its flush window ends."""


class GeneratorSide:
    """Mixed into `Orchestrator`; the attributes below are the orchestrator's, and so are the
    methods ``_send`` and ``_bad_message`` it calls."""

    admission: "Admission"
    announced_weight_epoch: int
    cfg: "OrchestratorConfig"
    clock: "PolicyClock"
    counts: "Counter[str]"
    generators: "GeneratorPool"
    incarnation: str
    metrics: "MetricsWriter"
    prompts: "PromptSource"
    scoring: "Scoring"
    weight_epoch: int | None

    def _on_start_progress(self, peer: bytes, msg: m.StartProgress) -> None:
        """A starting generator's heartbeat, from its own ``gen-<id>-start`` socket only."""
        if peer != f"gen-{msg.generator_id}-start".encode():
            self._bad_message(peer, msg.KIND, f"start progress of generator {msg.generator_id} from another socket")
            return
        self.generators.start_progress(f"gen-{msg.generator_id}".encode(), msg)

    def _on_hello(self, peer: bytes, msg: m.Hello) -> None:
        restarted = self.generators.hello(peer)
        if restarted:  # the old process's leases never come back
            self.counts["leases_released"] += self.admission.release_holder(peer)
        self._membership("restart" if restarted else "join", msg.generator_id, job=msg.job)
        self.clock.generator_joined(peer)
        if self.weight_epoch is not None:  # it must join the weight group before taking weights
            self._send(peer, m.Regroup(self.weight_epoch))
        if self.clock.announced is not None:
            self._send(peer, m.Update(self.clock.announced, self.announced_weight_epoch))

    def _on_leave(self, peer: bytes, msg: m.Leave) -> None:
        """A planned departure: its leases are re-issued now, it is no member from now on; it hears
        `Stop` once the trainer has listed the members without it (`_on_members`)."""
        self.generators.leave(peer)
        self.clock.generator_lost(peer)
        returned = self.admission.release_holder(peer)
        self.counts["leases_released"] += returned
        self.counts["generators_left"] += 1
        self._membership("leave", msg.generator_id, leases_returned=returned)
        log.info("generator %r leaves: %d lease(s) returned", peer, returned)

    def _membership(self, event: str, generator_id: int, **values) -> None:
        """One ``membership`` record in the metrics stream: a join, restart, leave, loss or regroup."""
        self.metrics.log("membership", event=event, generator_id=generator_id,
                         members=len(self.generators), **values)

    def _on_want(self, peer: bytes, msg: m.Want) -> None:
        self._credit(peer, msg.credit)

    def _credit(self, peer: bytes, credit: m.Credit) -> None:
        self.generators.set_credit(peer, credit, self.incarnation)
        self.clock.generator_loaded(peer, credit.loaded)

    def _on_members(self, peer: bytes, msg: m.ListMembers) -> None:
        """The trainer asks which generators are alive (to build the weight group)."""
        self._reap_dead()
        members = self.generators.members()
        members = {**members, **self.scoring.weight_members()}  # a lagged teacher receives the weights too
        self._send(peer, m.Members(members, self.generators.starts()))
        for gen in self.generators.released():  # the trainer's next group is built without them
            self._send(gen, m.Stop())

    def _on_regroup(self, peer: bytes, msg: m.Regroup) -> None:
        """The trainer rebuilt the weight group: every generator must join it."""
        self.weight_epoch = msg.weight_epoch
        self._membership("regroup", None, epoch=msg.weight_epoch)
        for gen in self.generators.listeners():
            self._send(gen, msg)
        self.scoring.regroup(msg.weight_epoch)

    def _reap_dead(self) -> None:
        """Release the leases of generators silent too long."""
        for peer in self.generators.reap():
            self.counts["generators_lost"] += 1
            self.clock.generator_lost(peer)
            self.counts["leases_released"] += self.admission.release_holder(peer)
            self._membership("lost", _generator_id(peer))
            log.warning("generator %r silent for %.0fs: its leases are re-issued", peer,
                        self.cfg.generator_dead_after_s)

    def _grant_due(self) -> bool:
        """Whether a generator has `GRANT_MIN` free slots (a grant before the window ends)."""
        return any(gen.credit >= GRANT_MIN for gen in self.generators.gens.values())

    def _grant_work(self) -> None:
        """One group at a time to each generator with credit in turn, so none is starved."""
        now = time.time()
        grants: dict[bytes, tuple[list, list]] = {}
        progress = True
        while progress:
            progress = False
            for peer, gen in self.generators.items():
                if gen.credit <= 0:
                    continue
                lease = self.admission.issue(peer, now)
                if lease is None:
                    break
                prompt = self.prompts.for_group(lease.group_id)
                items, prompts = grants.setdefault(peer, ([], []))
                items.append([lease.group_id, lease.attempt, prompt.prompt_id, self.cfg.group_size])
                prompts.append(prompt.token_ids)
                gen.credit -= 1
                gen.granted += 1
                progress = True
        for peer, (items, prompts) in grants.items():
            self._send(peer, m.Work(self.incarnation, self.clock.admission_version, items,
                                    prompt_arrays(prompts)))


def _generator_id(peer: bytes) -> int | None:
    """The rank in a generator's identity ``gen-<rank>`` (None: not one)."""
    name = peer.decode(errors="replace")
    return int(name[4:]) if name.startswith("gen-") and name[4:].isdigit() else None
