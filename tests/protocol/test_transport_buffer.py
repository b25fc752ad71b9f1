"""Transport details (secret, interfaces, timeouts) and the buffer's spill to the rollout log."""
from __future__ import annotations

import contextlib
import os
import stat
import time

import numpy as np
import pytest

from pipeline.orchestrator.buffer import BufferedGroup, RolloutBuffer
from pipeline.orchestrator.clock import is_stale
from pipeline.protocol.links import WorkItem
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.roles import ORCHESTRATOR_SERVES
from pipeline.rollout_log.writer import RolloutLogWriter
from pipeline.protocol.transport import (MessageClient, MessageServer, TransportConfig, TransportError,
                                interface_address, load_or_create_secret)

from support.loadgen import synthetic_group


def test_secret_is_private_stable_and_refused_when_exposed(tmp_path):
    key = load_or_create_secret(tmp_path)
    assert len(key) == 32 and load_or_create_secret(tmp_path) == key
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o600
    os.chmod(tmp_path / "secret", 0o644)
    with pytest.raises(TransportError, match="readable by others"):
        load_or_create_secret(tmp_path)


def test_interface_address_resolves_loopback_and_names_unknown_interfaces():
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(TransportError, match="nosuchif0"):
        interface_address("nosuchif0")


def test_only_holders_of_the_secret_are_heard_and_calls_time_out(tmp_path):
    key = load_or_create_secret(tmp_path)
    server = MessageServer(key, TransportConfig(), ORCHESTRATOR_SERVES)
    good = MessageClient(key, server.address, TransportConfig(), "gen-0")
    evil = MessageClient(b"e" * 32, server.address, TransportConfig(), "gen-1")
    try:
        with contextlib.suppress(TransportError):  # refused at once, or queued and never heard
            evil.send("hello", {"x": 1}, timeout_s=1.0)
        good.send("hello", {"x": 2}, {"a": np.arange(3)})
        got = server.recv(5.0)
        assert got is not None and got[0] == b"gen-0" and got[1].meta == {"x": 2}
        np.testing.assert_array_equal(got[1].arrays["a"], np.arange(3))
        assert server.recv(0.2) is None
        assert not server.dropped  # refused at the connection's handshake: never queued
        assert server.send(b"gen-0", "ack", {"ok": True})
        assert good.recv(5.0).meta == {"ok": True}
        t0 = time.monotonic()
        assert good.recv(0.3) is None and time.monotonic() - t0 >= 0.29
        assert not server.send(b"nobody", "ack")  # unroutable peer: counted, not raised
        assert server.dropped["send_failed"] == 1
    finally:
        for s in (good, evil, server):
            s.close()


def _group(gid: int, tokens: int, schema: RecordSchema):
    item = WorkItem(gid, 0, gid, 4, np.arange(1, 9, dtype=np.int32), version=gid)
    return synthetic_group(item, 0, schema, tokens, tokens)


def test_buffer_spills_beyond_its_budget_and_reads_back_identical_samples(tmp_path):
    schema = RecordSchema()
    writer = RolloutLogWriter(tmp_path / "rollouts", schema, "t", {})
    buf = RolloutBuffer(memory_token_budget=100, read_rows=writer.read_samples)
    originals = {}
    for gid in range(4):
        batch = _group(gid, 10, schema)  # 4 samples x (8 + 10) = 72 tokens per group
        rows = writer.append_samples(batch)
        originals[gid] = batch
        buf.add(BufferedGroup(gid, 0, rows, gid, batch.num_tokens, batch))
    writer.flush()
    assert buf.memory_tokens == 72 and buf.spilled == 3
    dropped = buf.drop(lambda g: is_stale(2, g.min_version, 1))  # version 0 is 2 behind
    assert [g.group_id for g in dropped] == [0]
    taken = buf.take(2)
    assert [g.group_id for g in taken] == [1, 2] and len(buf) == 1
    for g in taken:
        for name in ("completion_ids", "logprobs", "versions", "prompt_ids", "group_id"):
            np.testing.assert_array_equal(g.batch.columns[name], originals[g.group_id].columns[name])
    with pytest.raises(ValueError, match="asked for 2 groups, 1 buffered"):
        buf.take(2)
    writer.close()
