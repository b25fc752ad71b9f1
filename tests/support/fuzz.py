"""Signed mutations of every message kind, for the orchestrator fuzz test (`tests/orchestrator/test_security.py`).

A `Fuzzer` holds authenticated connections to a live orchestrator (the run secret, the PLAIN
credential, stamped origins) and sends, message by message, one of: a record of a random kind
with fields dropped, added, retyped or set to extreme values, or frames added; a well-formed
`Result` of several groups with one group (or the cut into groups) spoiled, its other groups
honest answers to work leased to the fuzzer (`Fuzzer.join`: they are stored, the spoiled one
refused alone); a kind sent from a role that may not send it; a replay of an earlier message; a
message stamped with another identity; a wrong MAC; random bytes. It counts what it tried per kind
and per way.

Test code, not part of the package.
"""
from __future__ import annotations

import dataclasses
import time
import typing
from collections import Counter

import numpy as np
import zmq

from pipeline.protocol import messages as m
from pipeline.protocol import wire
from pipeline.protocol.links import WorkItem
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.protocol.transport import connect_credential
from support.loadgen import synthetic_group

EXTREMES = [0, -1, 1, 2**31 - 1, 2**62, -2**63, 10**6, 1.5, float("nan"), float("inf"), "x", "", None,
            True, [], {}, [1, 2], {"a": 1}, b"\x00" * 3]


def _baseline(cls: type, rng: np.random.Generator) -> dict:
    """A plausible meta map for a record class (values of the right types)."""
    hints = typing.get_type_hints(cls)
    meta = {}
    for f in dataclasses.fields(cls):
        if f.name == "arrays":
            continue
        meta[f.name] = _value(hints[f.name], rng)
    return meta


def _value(tp, rng):
    import typing
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if args and origin is not list and origin is not dict:  # a union: one arm
        return _value(args[int(rng.integers(len(args)))], rng)
    if dataclasses.is_dataclass(tp):
        return _baseline(tp, rng)
    if origin is list:
        return [_value(args[0], rng) for _ in range(int(rng.integers(0, 3)))]
    if origin is dict:
        return {"k": _value(args[1], rng)}
    return {int: int(rng.integers(0, 8)), float: float(rng.random()), str: "ab", bool: True,
            type(None): None}.get(tp, 0)


def _arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    names = ["eval_index", "prompt_ids", "prompt_len", "dp_rank", "completion_ids", "versions", "x"]
    out = {}
    for _ in range(int(rng.integers(0, 4))):
        dtype = rng.choice([np.int64, np.int32, np.float32, np.uint8, np.float64])
        shape = [int(rng.integers(0, 5)) for _ in range(int(rng.integers(1, 3)))]
        out[str(rng.choice(names))] = np.clip(rng.standard_normal(shape) * 1e9, -2e9, 2e9).astype(dtype)
    return out


def _spoiled_groups(rng: np.random.Generator, work: list[WorkItem]) -> tuple[dict, dict[str, np.ndarray], str]:
    """A multi-group `Result` of 2-4 groups (answers to ``work``, the fuzzer's leased groups, while
    it holds 2; else groups of 4 samples with random ids) with one group's samples spoiled (a
    header/column mismatch, an impossible value) or the cut into groups wrong (a sample or a
    column missing): its meta, arrays and what was spoiled."""
    if len(work) >= 2:
        picked = rng.choice(len(work), min(len(work), int(rng.integers(2, 5))), replace=False)
        items = [work[int(k)] for k in picked]
    else:
        items = [WorkItem(int(g), 0, int(g), 4, rng.integers(0, 1000, 6, dtype=np.int32), 0)
                 for g in rng.choice(64, int(rng.integers(2, 5)), replace=False)]
    batch = SampleBatch.concat([synthetic_group(i, 7, RecordSchema(), 2, 6) for i in items])
    cols = {name: a.copy() for name, a in batch.columns.items()}
    row = int(rng.integers(items[0].n))  # in the first group: the others stay honest
    spoil = str(rng.choice(["attempt", "group_id", "token", "version", "time", "column", "sample"]))
    if spoil in ("attempt", "group_id"):  # the sample's column disagrees with the header
        cols[spoil][row] += 1
    elif spoil == "token":
        cols["completion_ids"][int(rng.integers(int(cols["completion_len"][0])))] = 2**31 - 1
    elif spoil == "version":
        cols["versions"][:int(cols["completion_len"][:items[0].n].sum())] = 10**6
    elif spoil == "time":
        cols["t_start"][row] = np.nan
    elif spoil == "column":
        cols.pop(str(rng.choice(sorted(cols))))
    else:  # one sample short of whole groups
        cols = dict(batch.take(range(len(batch) - 1)).columns)
    return {"groups": [[i.group_id, i.attempt] for i in items], "credit": None}, cols, spoil


class Fuzzer:
    def __init__(self, key: bytes, address: str, seed: int = 0):
        self.key, self.rng = key, np.random.default_rng(seed)
        self.ctx = zmq.Context.instance()
        user, password = connect_credential(key)
        self.socks: dict[str, zmq.Socket] = {}
        self.senders: dict[str, wire.Sender] = {}
        for identity in ("gen-6", "gen-7", "gen-8", "trainer-7"):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100_000)
            s.setsockopt(zmq.PLAIN_USERNAME, user)
            s.setsockopt(zmq.PLAIN_PASSWORD, password)
            s.setsockopt(zmq.IDENTITY, identity.encode())
            s.connect(address)
            self.socks[identity] = s
            self.senders[identity] = wire.Sender(identity, "trainer" if identity.startswith("t") else "generator")
        self.tried: Counter[str] = Counter()
        self.ways: Counter[str] = Counter()
        self.spoiled: Counter[str] = Counter()
        """Multi-group results sent, by what was spoiled in them."""
        self.work: list[WorkItem] = []
        """Groups leased to the fuzzer's generator ``gen-7`` (`join`)."""

        self.last: tuple[str, list[bytes]] | None = None
        """The last signed message sent with its connection's own stamp (what "replay" sends again)."""

    def join(self, timeout_s: float = 10.0) -> None:
        """Join as generator ``gen-7`` with 8 free slots and open admission (a trainer's version
        report): the orchestrator leases it work, whose honest answers go beside spoiled groups."""
        for identity, msg in (("gen-7", m.Hello(7)), ("gen-7", m.Want(m.Credit(8, 0, None, 0))),
                              ("trainer-7", m.TrainerVersion(0))):
            self._send(identity, wire.encode(self.key, *m.encode(msg), self.senders[identity]))
        deadline = time.monotonic() + timeout_s
        while len(self.work) < 2:
            assert time.monotonic() < deadline, "the orchestrator leased the fuzzer no work"
            time.sleep(0.05)
            self._drain("gen-7")

    def _drain(self, identity: str) -> None:
        """Take the answers waiting on a connection (`Error` records, work for ``gen-7``)."""
        sock = self.socks[identity]
        try:
            while True:
                frames = sock.recv_multipart(zmq.NOBLOCK)
                try:
                    msg = m.decode(wire.decode(self.key, frames, 1 << 26))
                except (wire.FrameError, m.MessageError):
                    continue
                if isinstance(msg, m.Work) and identity == "gen-7":
                    ends = np.cumsum(msg.arrays["prompt_len"])
                    for (gid, attempt, pid, n), prompt in zip(msg.items, np.split(msg.arrays["prompt_ids"], ends[:-1])):
                        self.work.append(WorkItem(gid, attempt, pid, n, prompt, msg.version))
                    del self.work[:-16]  # the newest leases
        except zmq.Again:
            pass

    def _send(self, identity: str, frames: list, replayable: bool = False) -> None:
        frames = [bytes(f) for f in frames]
        self.socks[identity].send_multipart(frames)
        if replayable:
            self.last = identity, frames
        self._drain(identity)  # so nothing piles up here

    def one(self) -> None:
        rng = self.rng
        way = str(rng.choice(["mutate", "mutate", "mutate", "mutate", "role", "replay", "stamp", "mac",
                              "bytes", "groups"], p=[.18, .18, .18, .14, .07, .06, .04, .04, .04, .07]))
        if way == "groups":  # a multi-group result, one group or the cut spoiled
            meta, arrays, spoil = _spoiled_groups(rng, self.work)
            self.tried[m.Result.KIND] += 1
            self.ways["groups"] += 1
            self.spoiled[spoil] += 1
            self._send("gen-7", wire.encode(self.key, m.Result.KIND, meta, arrays, self.senders["gen-7"]),
                       replayable=True)
            return
        kind = str(rng.choice(sorted(m.KINDS)))
        cls = m.KINDS[kind]
        meta = _baseline(cls, rng)
        for _ in range(int(rng.integers(1, 4))):  # mutate: drop, add, or set a field
            op = rng.integers(0, 3)
            if op == 0 and meta:
                meta.pop(str(rng.choice(sorted(meta))))
            elif op == 1:
                meta[str(rng.choice(["extra", "free", "step", "dp_size", "version", "epoch"]))] = \
                    EXTREMES[int(rng.integers(len(EXTREMES)))]
            elif meta:
                meta[str(rng.choice(sorted(meta)))] = EXTREMES[int(rng.integers(len(EXTREMES)))]
        arrays = _arrays(rng) if rng.random() < 0.5 else {}
        identity = "trainer-7" if kind in {c.KIND for c in (m.TrainerVersion, m.Resume, m.GetBatch,
                                                             m.EvalRequest, m.WeightsAnnounced,
                                                             m.ListMembers, m.Regroup, m.Finish)} else "gen-7"
        if identity == "trainer-7" and way == "mutate":
            try:  # a well-formed trainer command would steer the run (finish it, roll it back)
                m.decode(wire.Message(kind, meta, arrays))
                way = "role"
            except m.MessageError:
                pass
        if way == "role":  # a well-formed message from a role that may not send it
            identity = "gen-8" if identity == "trainer-7" else "trainer-7"
            if kind in (m.Finish.KIND, m.Resume.KIND, m.Regroup.KIND, m.WeightsAnnounced.KIND,
                        m.TrainerVersion.KIND):
                identity = "gen-8"
        self.tried[kind] += 1
        self.ways[way] += 1
        if way == "replay" and self.last is not None:
            self.socks[self.last[0]].send_multipart(self.last[1])
            return
        if way == "bytes":
            frames = [rng.bytes(int(rng.integers(0, 200))) for _ in range(int(rng.integers(1, 6)))]
            self._send("gen-6", frames)  # wrong MACs and garbage come from gen-6, soon ignored
            return
        sender = self.senders[identity]
        if way == "stamp":  # stamped with another identity than the connection's
            sender = wire.Sender("trainer-0", "trainer")
        if way == "mac":
            identity, sender = "gen-6", self.senders["gen-6"]
        frames = wire.encode(b"w" * 32 if way == "mac" else self.key, kind, meta, arrays, sender)
        self._send(identity, frames, replayable=way in ("mutate", "role"))

    def close(self) -> None:
        for s in self.socks.values():
            s.close(0)
