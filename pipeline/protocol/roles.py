"""Who may send what: the roles of the control protocol and the message kinds each one sends.

A sender's role follows from its ZeroMQ identity (``gen-<rank>``: a generator, ``trainer-<rank>``:
a trainer rank, ``orchestrator``: the orchestrator and its scorer pool, anything else: a scorer
role such as ``reward-0-<pid>``); both ends stamp it into the authenticated part of every message
(`pipeline.protocol.wire.Origin`) and the receiver checks stamp, identity and role agree
(`pipeline.protocol.transport`). The orchestrator then takes a kind only from the role listed for
it in `SENDS` (`may_send`): a generator's ``resume`` or ``finish`` is refused like a malformed one.

Example: ``role_of("gen-3")`` is ``"generator"``; ``may_send("generator", Resume)`` is False.
"""
from __future__ import annotations

from pipeline.protocol import messages as m

ORCHESTRATOR = "orchestrator"
GENERATOR = "generator"
TRAINER = "trainer"
SCORER = "scorer"

SENDS: dict[str, frozenset[type]] = {
    GENERATOR: frozenset({m.StartProgress, m.Hello, m.Leave, m.Want, m.Result, m.EvalResult}),
    TRAINER: frozenset({m.TrainerVersion, m.Resume, m.GetBatch, m.EvalRequest, m.WeightsAnnounced,
                        m.ListMembers, m.Regroup, m.Finish}),
    ORCHESTRATOR: frozenset({m.Work, m.Ack, m.EvalWork, m.Update, m.Stop, m.Batch, m.Members,
                             m.Regroup, m.Error}),
}
"""The records each role sends (scorer roles speak the scorer pool's own kinds)."""


def role_of(identity: str) -> str:
    """The role a ZeroMQ identity belongs to."""
    if identity == ORCHESTRATOR:
        return ORCHESTRATOR
    for prefix, role in (("gen-", GENERATOR), ("trainer-", TRAINER)):
        if identity.startswith(prefix):
            return role
    return SCORER


def may_send(role: str, record: type) -> bool:
    return record in SENDS.get(role, frozenset())


ORCHESTRATOR_SERVES = frozenset({GENERATOR, TRAINER})
"""The roles the orchestrator's socket takes messages from."""
SCORER_POOL_SERVES = frozenset({SCORER})
"""The roles the scorer pool's socket takes messages from."""
