"""The weight stream's side-channel records through the one codec (`codec.pack` / `codec.unpack`),
and the signature of weight-store values (`weight_stream.signed` / `verified`)."""
from __future__ import annotations

import msgpack
import pytest

from pipeline.protocol import codec
from pipeline.protocol import weight_stream as ws

EXAMPLES = [
    ws.UpdateHeader(7, [[64, 0, [["w", "float32", [4, 4], 0]]]]),
    ws.IpcHandle([0, b"\x01handle", 128, 0, b"ref", 4, b"ev", True], 64, 64),
    ws.IpcExport(3, [[64, 0, []]], [codec.pack(ws.IpcHandle([0], 0, 64))]),
    ws.ReceivePost(7), ws.ReceivePost(None), ws.ReceivePostAnswer(True), ws.ReceivePostAnswer(False, "boom"),
]


@pytest.mark.parametrize("record", EXAMPLES, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_the_codec(record):
    raw = codec.pack(record)
    assert msgpack.unpackb(raw)["kind"] == record.KIND
    assert codec.unpack(type(record), raw) == record


def test_the_worked_example_of_the_module_docstring():
    assert codec.pack(ws.ReceivePost(version=7)) == msgpack.packb({"kind": "receive_post", "version": 7})


@pytest.mark.parametrize("cls, doc, problem", [
    (ws.ReceivePost, {"kind": "receive_post", "version": "7"}, "version: expected int | None, got str"),
    (ws.ReceivePost, {"kind": "receive_post_answer", "ok": True}, "got receive_post_answer instead"),
    (ws.UpdateHeader, {"kind": "update_header", "version": 1}, "missing field plan"),
    (ws.UpdateHeader, {"kind": "update_header", "version": 1, "plan": [], "x": 0}, "unknown field(s) x"),
    (ws.IpcExport, {"kind": "ipc_export", "version": 1, "plan": [], "buckets": ["text"]},
     "buckets[0]: expected bytes, got str"),
    (ws.ReceivePostAnswer, [1, 2], "got list instead"),
])
def test_a_malformed_record_raises_one_clear_error(cls, doc, problem):
    with pytest.raises(codec.MessageError) as err:
        codec.unpack(cls, msgpack.packb(doc))
    assert err.value.kind == cls.KIND and problem in err.value.detail, err.value


def test_bytes_that_are_not_msgpack_raise_a_message_error():
    with pytest.raises(codec.MessageError, match="not msgpack"):
        codec.unpack(ws.UpdateHeader, b"\xc1\x00garbage")


def test_a_store_value_verifies_only_under_its_key_and_name():
    key = ws.store_key(b"s" * 32)
    raw = ws.signed(key, "u0/meta", b"value")
    assert len(raw) == ws.SIGNATURE_BYTES + 5 and ws.verified(key, "u0/meta", raw) == b"value"
    forged = [("another key", ws.store_key(b"t" * 32), "u0/meta", raw),
              ("moved to another name", key, "u0/b0", raw),
              ("changed", key, "u0/meta", raw[:-1] + b"E"),
              ("unsigned", key, "u0/meta", b"value"), ("empty", key, "u0/meta", b"")]
    for what, k, name, value in forged:
        with pytest.raises(ws.StoreSignatureError, match="not signed with this run's secret"):
            ws.verified(k, name, value)
            pytest.fail(f"{what} value verified")
