"""The typed control protocol: every record survives the authenticated wire unchanged, and every
malformed message becomes one `MessageError` naming its kind and problem (never a KeyError)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.protocol import wire
from pipeline.protocol import messages as m

KEY = bytes(range(32))


def through_wire(kind: str, meta: dict, arrays: dict | None) -> wire.Message:
    frames = [bytes(f) for f in wire.encode(KEY, kind, meta, arrays)]
    return wire.decode(KEY, frames, 1 << 20)


PROMPTS = {"prompt_ids": np.arange(7, dtype=np.int32), "prompt_len": np.array([3, 4], np.int32)}
EXAMPLES = [
    m.Hello(3), m.Hello(4, "genjob-0"), m.Leave(4, 2), m.Want(m.Credit(2, 5, "ab12", None)), m.Want(m.Credit(0, 0, None, 4)),
    m.Result([[7, 1]], m.Credit(1, 9, "e", 2), {"reward": np.zeros(4, np.float32)}), m.Result([[7, 2]]),
    m.Result([[7, 1], [9, 0], [8, 3]], m.Credit(3, 9, "e", 2), {"group_id": np.repeat([7, 9, 8], 2)}),
    m.EvalResult(3, {"eval_index": np.arange(2)}), m.Work("e", 4, [[1, 0, 11, 8], [2, 1, 12, 8]], PROMPTS),
    m.Ack([[1, 0, "stored"], [2, 1, "filtered"]]), m.EvalWork(6, [0, 1], PROMPTS), m.Update(5), m.Stop(),
    m.GetBatch(4, 3, 2, 1), m.GetBatch(4, 3, 1), m.Batch(4, 1, {"dp_rank": np.zeros(3, np.int16)}),
    m.TrainerVersion(9), m.Resume(8), m.EvalRequest(3, 3), m.WeightsAnnounced(6), m.ListMembers(),
    m.Members({"gen-0": 1, "gen-1": 3}), m.Members({}, [m.StartStatus("gen-2", "engine", 41.5, 0.8)]),
    m.StartProgress(2, "warm-up", 12.25), m.Regroup(2), m.Finish(), m.Error("want", "credit.free: expected int"),
]


def test_every_kind_has_an_example_and_round_trips_through_the_authenticated_wire():
    assert {type(e) for e in EXAMPLES} == set(m.KINDS.values())
    for msg in EXAMPLES:
        back = m.decode(through_wire(*m.encode(msg)))
        assert type(back) is type(msg)
        for f in dataclasses.fields(msg):
            a, b = getattr(msg, f.name), getattr(back, f.name)
            if f.name == "arrays":
                assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
            else:
                assert a == b, (msg, f.name)


def test_the_worked_example_of_the_module_docstring():
    assert m.encode(m.Want(m.Credit(free=2, received=5, incarnation="ab12", loaded=3))) == (
        "want", {"credit": {"free": 2, "received": 5, "incarnation": "ab12", "loaded": 3}}, None)


@pytest.mark.parametrize("kind, meta, arrays, problem", [
    ("nope", {}, None, "unknown message kind"),
    ("want", {"credit": {"free": "2", "received": 5, "incarnation": None, "loaded": None}}, None,
     "credit.free: expected int, got str"),
    ("want", {}, None, "missing field credit"),
    ("want", {"credit": {"free": 1, "received": 0, "incarnation": None}}, None, "missing field credit.loaded"),
    ("hello", {"generator_id": True}, None, "generator_id: expected int, got bool"),
    ("hello", {"generator_id": 1, "x": 2}, None, "unknown field(s) x"),
    ("result", {"groups": [[1, "x"]]}, None, "groups[0][1]: expected int, got str"),
    ("result", {"groups": [[1, 0], [2, True]]}, None, "groups[1][1]: expected int, got bool"),
    ("ack", {"groups": [[1, 0, "stored"], [2, 0, 1.5]]}, None, "groups[1][2]: expected int | str, got float"),
    ("result", {"group_id": 1, "attempt": 0}, None, "unknown field(s) attempt, group_id"),
    ("result", {"groups": []}, None, "groups must be one or more [group_id, attempt]"),
    ("result", {"groups": [[1, 0, 2]]}, None, "groups must be one or more [group_id, attempt]"),
    ("result", {"groups": [[1, -1]]}, None, "groups must be one or more [group_id, attempt]"),
    ("result", {"groups": [[1, 0], [2, 0], [1, 1]]}, None, "groups names a group id twice"),
    ("work", {"incarnation": "e", "version": 1, "items": [[1, 0, 2, 4]]}, {"prompt_ids": np.zeros(2, np.int32)},
     "missing array frame(s) prompt_len"),
    ("work", {"incarnation": "e", "version": 1, "items": [[1, "a"]]}, PROMPTS, "items[0][1]: expected int"),
    ("members", {"members": {"gen-0": None}}, None, "members['gen-0']: expected int"),
    ("get_batch", {"step": 1, "version": 1, "dp_size": 1, "dp_rank": 1.5}, None, "dp_rank: expected"),
    ("stop", {}, {"x": np.zeros(1)}, "carries array frames"),
    ("ack", [], None, "expected a map"),
    ("get_batch", {"step": 1, "version": 1, "dp_size": 0}, None, "dp_size must be >= 1, got 0"),
    ("get_batch", {"step": 1, "version": 1, "dp_size": 2, "dp_rank": 2}, None, "dp_rank 2 is not below"),
    ("work", {"incarnation": "e", "version": 1, "items": [[1, 0, 2]]}, PROMPTS, "items must be"),
    ("ack", {"groups": [[1, 0]]}, None, "groups must be"),
    ("resume", {"step": -1}, None, "step must be >= 0, got -1"),
    # a trainer-key holder's version past int32 would wrap where generators stamp their tokens
    ("get_batch", {"step": 1, "version": 2**62, "dp_size": 1}, None, "version must be <= 2147483647 (int32)"),
    ("version", {"version": 2**31}, None, "version must be <= 2147483647 (int32)"),
    ("result", {"groups": [[1, 0]], "credit": {"free": 1, "received": 0, "incarnation": None,
                                                        "loaded": 2**31}}, None, "loaded must be <= 2147483647"),
    ("result", {"groups": [[1, 0]], "credit": {"free": -1, "received": 0, "incarnation": None,
                                                        "loaded": None}}, None, "free must be >= 0"),
])
def test_malformed_messages_raise_one_clear_error(kind, meta, arrays, problem):
    raw = wire.Message(kind, meta, arrays or {}) if not isinstance(meta, dict) else through_wire(kind, meta, arrays)
    with pytest.raises(m.MessageError) as err:
        m.decode(raw)
    assert err.value.kind == kind and problem in err.value.detail, err.value
