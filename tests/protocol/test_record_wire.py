"""The rollout record and its wire codec: validation, round trips, authentication, bad frames."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pipeline.protocol import wire
from pipeline.protocol.record import FINISH_REASONS, RecordError, RecordSchema, RolloutSample
from pipeline.protocol.sample_batch import SampleBatch

KEY = b"k" * 32


@st.composite
def schemas(draw):
    return RecordSchema(
        token_rewards=draw(st.booleans()), teacher_logprobs=draw(st.booleans()),
        routed_experts=draw(st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 3)))),
        sampling_mask_k=draw(st.one_of(st.none(), st.integers(1, 4))))


@st.composite
def samples(draw, schema):
    n = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    plen, clen = draw(st.integers(1, 20)), draw(st.integers(1, 30))
    v0 = draw(st.integers(0, 5))
    out = []
    for i in range(n):
        kw = {}
        for name, (dtype, trail) in schema.token_fields().items():
            if name in ("completion_ids", "logprobs", "versions"):
                continue
            kw[name] = rng.integers(0, 5, (clen, *trail)).astype(dtype)
        for name, (dtype, trail) in schema.prompt_token_fields().items():
            kw[name] = rng.integers(0, 5, (plen, *trail)).astype(dtype)
        out.append(RolloutSample(
            group_id=7, sample_index=i, prompt_id=3, attempt=draw(st.integers(0, 3)),
            prompt_ids=rng.integers(0, 1000, plen), completion_ids=rng.integers(0, 1000, clen),
            logprobs=-rng.exponential(1.0, clen), versions=np.sort(rng.integers(v0, v0 + 3, clen)),
            finish_reason=draw(st.sampled_from(FINISH_REASONS)), reward=float(rng.random()),
            generator_id=2, t_start=1.5, t_end=2.5, schema=schema, **kw))
    return out


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_batch_round_trips_through_the_wire(data):
    schema = data.draw(schemas())
    ss = data.draw(samples(schema))
    batch = SampleBatch.from_samples(ss, schema)
    frames = wire.encode(KEY, "result", {"group_id": 7}, batch.columns)
    msg = wire.decode(KEY, [bytes(f) for f in frames], max_bytes=1 << 30)
    got = SampleBatch(msg.arrays, schema)
    assert msg.kind == "result" and msg.meta == {"group_id": 7}
    for a, b in zip(ss, got):
        for name in ("prompt_ids", *schema.prompt_token_fields(), *schema.token_fields()):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert (a.group_id, a.sample_index, a.attempt, a.finish_reason) == \
               (b.group_id, b.sample_index, b.attempt, b.finish_reason)
        assert a.reward == pytest.approx(b.reward)
    # take() reorders rows consistently
    order = np.arange(len(batch))[::-1]
    rev = batch.take(order)
    for i, j in enumerate(order):
        np.testing.assert_array_equal(rev.tokens("completion_ids", i), batch.tokens("completion_ids", j))
        for name in schema.prompt_token_fields():
            np.testing.assert_array_equal(rev.prompt(i, name), batch.prompt(j, name))


def test_decoded_arrays_are_zero_copy_views():
    arr = np.arange(1000, dtype=np.int32)
    frames = [bytes(f) for f in wire.encode(KEY, "x", {}, {"a": arr})]
    msg = wire.decode(KEY, frames, 1 << 20)
    assert msg.arrays["a"].base is not None and not msg.arrays["a"].flags.writeable
    np.testing.assert_array_equal(msg.arrays["a"], arr)


def test_an_array_in_pieces_is_one_frame_of_their_bytes_under_one_mac():
    """`wire.Pieces`: the frame is the pieces' bytes in order, sent from their memory, and its MAC
    is the MAC of the joined frame (decode checks it over the joined bytes)."""
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 99, (n, 2), dtype=np.int32) for n in (3000, 1, 0, 700)]  # large, small, empty
    frames = wire.encode_frames(KEY, "x", {"k": 1}, {"a": wire.Pieces(parts), "b": np.arange(5.0)})
    assert [len(f) for f in frames[2:]] == [3, 5 * 8]  # a's non-empty pieces; b's bytes
    assert np.shares_memory(np.frombuffer(frames[2][0], np.int32), parts[0])
    msg = wire.decode(KEY, [b"".join(bytes(p) for p in f) if type(f) is list else f for f in frames], 1 << 20)
    np.testing.assert_array_equal(msg.arrays["a"], np.concatenate(parts))
    np.testing.assert_array_equal(msg.arrays["b"], np.arange(5.0))
    joined = wire.encode(KEY, "x", {}, {"a": wire.Pieces(parts)})  # one buffer a frame
    np.testing.assert_array_equal(wire.decode(KEY, joined, 1 << 20).arrays["a"], np.concatenate(parts))
    with pytest.raises(ValueError, match="dtype or trailing shape"):
        wire.Pieces([parts[0], parts[1].astype(np.int64)])


def _sample(**kw):
    base = dict(group_id=0, sample_index=0, prompt_id=0, attempt=0, prompt_ids=[1, 2],
                completion_ids=[3, 4], logprobs=[-0.5, -0.1], versions=[0, 1], finish_reason="stop")
    base.update(kw)
    return RolloutSample(**base)


@pytest.mark.parametrize("kw, needle", [
    ({"logprobs": [-0.5]}, "logprobs has 1 entries"),
    ({"versions": [1, 0]}, "decrease"),
    ({"logprobs": [0.5, -1]}, "positive"),
    ({"logprobs": [np.nan, -1]}, "NaN"),
    ({"completion_ids": [-1, 2]}, "negative token"),
    ({"finish_reason": "timeout"}, "finish_reason"),
    ({"group_id": -1}, "group_id"),
    ({"prompt_ids": []}, "prompt_ids is empty"),
    ({"token_rewards": [0.0, 1.0]}, "does not enable"),
    ({"completion_ids": [1.5, 2.5]}, "dtype"),
])
def test_invalid_samples_are_refused_with_the_field_named(kw, needle):
    with pytest.raises(RecordError, match=needle):
        _sample(**kw)


def test_schema_fields_are_required():
    schema = RecordSchema(teacher_logprobs=True)
    with pytest.raises(RecordError, match="teacher_logprobs is required"):
        _sample(schema=schema)
    assert RecordSchema.from_dict(schema.to_dict()) == schema


def test_batch_validation_catches_inconsistent_columns():
    b = SampleBatch.from_samples([_sample(), _sample(sample_index=1)], RecordSchema())
    cols = dict(b.columns)
    cols["completion_len"] = np.array([2, 3], np.int32)
    with pytest.raises(RecordError, match="completion_ids"):
        SampleBatch(cols, RecordSchema())
    cols = dict(b.columns)
    del cols["versions"]
    with pytest.raises(RecordError, match="missing \\['versions'\\]"):
        SampleBatch(cols, RecordSchema())


def test_rows_are_views_equal_to_taking_those_rows_and_a_replaced_column_keeps_the_rest():
    schema = RecordSchema(routed_experts=(2, 2))
    samples = [_sample(schema=schema, sample_index=i, prompt_ids=list(range(1, 2 + i)),
                       completion_ids=[3] * (i + 1), logprobs=[-0.5] * (i + 1), versions=[0] * (i + 1),
                       prompt_routed_experts=np.full((i + 1, 2, 2), i, np.int16),
                       routed_experts=np.full((i + 1, 2, 2), i, np.int16)) for i in range(5)]
    batch = SampleBatch.from_samples(samples, schema)
    part = batch.rows(1, 4)
    taken = batch.take([1, 2, 3])  # a copy, gathered row by row: the reference
    for name, column in taken.columns.items():
        np.testing.assert_array_equal(part.columns[name], column)
        assert np.shares_memory(part.columns[name], batch.columns[name])
    assert [part.tokens("completion_ids", i).tolist() for i in range(3)] == [[3] * 2, [3] * 3, [3] * 4]
    rewarded = part.with_column("reward", np.arange(3, dtype=np.float32))
    assert rewarded.columns["reward"].tolist() == [0, 1, 2] and part.columns["reward"].tolist() != [0, 1, 2]
    np.testing.assert_array_equal(rewarded.prompt(2), taken.prompt(2))
    with pytest.raises(RecordError, match="completion_len"):
        part.with_column("completion_len", np.ones(3, np.int32))


def test_tampered_or_foreign_frames_are_rejected_by_reason():
    frames = [bytes(f) for f in wire.encode(KEY, "x", {"a": 1}, {"v": np.ones(4, np.float32)})]
    bad_key = [bytes(f) for f in wire.encode(b"z" * 32, "x", {"a": 1}, {"v": np.ones(4, np.float32)})]
    with pytest.raises(wire.FrameError) as e:
        wire.decode(KEY, bad_key, 1 << 20)
    assert e.value.reason == "unauthenticated"
    tampered = list(frames)
    tampered[2] = b"\x00" * len(frames[2])
    with pytest.raises(wire.FrameError) as e:
        wire.decode(KEY, tampered, 1 << 20)
    assert e.value.reason == "unauthenticated"
    with pytest.raises(wire.FrameError) as e:
        wire.decode(KEY, frames, 10)
    assert e.value.reason == "oversized"
    with pytest.raises(wire.FrameError) as e:
        wire.decode(KEY, frames[:1], 1 << 20)
    assert e.value.reason == "malformed"


def test_signed_but_inconsistent_array_specs_are_malformed():
    import msgpack
    header = msgpack.packb({"v": wire.PROTOCOL_VERSION, "kind": "x", "meta": {}, "arrays": [["v", "<f4", [5]]]})
    body = np.ones(4, np.float32).tobytes()
    frames = [wire._mac(KEY, [header, body]), header, body]
    with pytest.raises(wire.FrameError, match="16 bytes for shape"):
        wire.decode(KEY, frames, 1 << 20)
    header = msgpack.packb({"v": wire.PROTOCOL_VERSION, "kind": "x", "meta": {}, "arrays": [["v", "|O", [2]]]})
    frames = [wire._mac(KEY, [header, body]), header, body]
    with pytest.raises(wire.FrameError, match="not allowed"):
        wire.decode(KEY, frames, 1 << 20)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 7, 64, wire.SMALL_PART, wire.SMALL_PART + 1, 40_000]), max_size=20),
       st.integers(0, 2**32))
def test_the_mac_is_gmac_over_the_length_prefixed_concatenation(sizes, seed):
    """Small parts are fed to GHASH joined, large ones alone: the tag is the one of a single
    GMAC over every length prefix and part in order (computed here in one call)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    rng = np.random.default_rng(seed)
    key, nonce = rng.bytes(32), rng.bytes(wire.NONCE_BYTES)
    parts = [rng.bytes(n) for n in sizes]
    ctx = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    ctx.authenticate_additional_data(b"".join(len(p).to_bytes(8, "little") + p for p in parts))
    ctx.finalize()
    assert wire._mac(key, [memoryview(p) for p in parts], nonce) == nonce + ctx.tag
