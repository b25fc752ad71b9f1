"""A generator's finished groups travel together (`pipeline/protocol/links.py`): the groups queued
before a poll leave in as few `Result` messages as ``max_groups_per_result`` and ``max_message_mb``
allow, with one credit; re-sends due together are packed the same way, without a credit. A real
`GeneratorLink` against a real authenticated `MessageServer` in this process."""
from __future__ import annotations

import time

import numpy as np

from pipeline.protocol import messages as m
from pipeline.protocol.links import HEADER_ROOM, GeneratorLink, WorkItem, bind_server, write_rendezvous
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.protocol.transport import TransportConfig
from support.loadgen import synthetic_group

SCHEMA = RecordSchema()


def _results(server, n: int) -> list[m.Result]:
    got, deadline = [], time.monotonic() + 10
    while len(got) < n:
        assert time.monotonic() < deadline, f"received {len(got)} of {n} results"
        raw = server.recv(0.2)
        if raw is not None and raw[1].kind == m.Result.KIND:
            got.append(m.decode(raw[1]))
    return got


def _link_and_server(run_dir, cfg: TransportConfig, resend_after_s: float = 60.0):
    server = bind_server(run_dir, cfg)
    write_rendezvous(run_dir, {"address": server.address, "incarnation": "i0"})
    link = GeneratorLink(run_dir, 0, slots=8, schema=SCHEMA, cfg=cfg, resend_after_s=resend_after_s)
    return server, link


def _groups(n: int) -> list[tuple[WorkItem, SampleBatch]]:
    items = [WorkItem(10 + k, k % 2, 3, 4, np.arange(5, dtype=np.int32) + k, 0) for k in range(n)]
    return [(item, synthetic_group(item, 0, SCHEMA, 8, 24)) for item in items]


def _check_packs(packs: list[m.Result], groups: list[tuple[WorkItem, SampleBatch]]) -> None:
    """The packs hold every group in order, their columns exactly the groups' concatenated."""
    assert [pair for r in packs for pair in r.groups] == [[i.group_id, i.attempt] for i, _ in groups]
    at = 0
    for r in packs:
        sent = SampleBatch.concat([b for _, b in groups[at:at + len(r.groups)]])
        assert r.arrays.keys() == sent.columns.keys()
        for name, column in sent.columns.items():
            np.testing.assert_array_equal(r.arrays[name], column)
        at += len(r.groups)


def test_groups_queued_before_a_poll_leave_in_messages_of_at_most_max_groups(tmp_path):
    server, link = _link_and_server(tmp_path, TransportConfig(max_groups_per_result=2))
    try:
        groups = _groups(5)
        for item, batch in groups:
            link.active.add(item.group_id)
        for item, batch in groups:
            link.queue_result(item, batch)
        assert not link.unacked  # queued, not sent yet
        link.poll(0.0)
        packs = _results(server, 3)
        assert [len(r.groups) for r in packs] == [2, 2, 1]
        _check_packs(packs, groups)
        assert all(r.credit is not None and r.credit.free == 8 for r in packs)  # every slot freed
        assert set(link.unacked) == {(i.group_id, i.attempt) for i, _ in groups}
    finally:
        link.close()
        server.close()


def test_the_byte_bound_cuts_a_pack_before_the_message_bound_and_resends_are_packed(tmp_path):
    groups = _groups(4)
    most = max(sum(a.nbytes for a in b.columns.values()) for _, b in groups)
    mb = (HEADER_ROOM + 2.5 * most) / 2**20  # two groups fit in a message, three do not
    server, link = _link_and_server(tmp_path, TransportConfig(max_message_mb=mb), resend_after_s=0.3)
    try:
        for item, batch in groups:
            link.queue_result(item, batch)
        link.send_results()
        packs = _results(server, 2)
        assert [len(r.groups) for r in packs] == [2, 2]
        _check_packs(packs, groups)
        server.send(b"gen-0", *m.encode(m.Ack([[groups[1][0].group_id, groups[1][0].attempt, "stored"]])))
        deadline = time.monotonic() + 10
        while (groups[1][0].group_id, groups[1][0].attempt) in link.unacked:
            assert time.monotonic() < deadline, "the ack did not arrive"
            link.poll(0.05)
        while server.recv(0.05) is not None:  # re-sends while the ack travelled, if any
            pass
        time.sleep(0.35)
        link.poll(0.0)  # the three unacknowledged groups are due together: re-sent packed, no credit
        resent = _results(server, 2)
        assert all(r.credit is None for r in resent)
        rest = [groups[0], groups[2], groups[3]]
        assert [len(r.groups) for r in resent] == [2, 1]
        _check_packs(resent, rest)
    finally:
        link.close()
        server.close()
