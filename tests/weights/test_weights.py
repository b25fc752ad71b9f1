"""Packed weight buckets and the gloo weight channel between real processes."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pipeline.protocol import codec, weight_stream
from pipeline.launch.rendezvous import free_port
from pipeline.weights.bucket_plan import ALIGN, BucketError, BucketPlan
from pipeline.weights.buckets import Assembly, pack, unpack
from pipeline.weights.group import TorchDistChannel, WeightSyncError

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


def _random_tensor(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.tuples(st.lists(st.integers(0, 40), min_size=0, max_size=3),
                                 st.sampled_from(range(len(DTYPES)))), min_size=1, max_size=12),
       bucket_bytes=st.integers(200, 3000), seed=st.integers(0, 2**31 - 1))  # >= 200: few pieces per tensor
def test_pack_unpack_round_trip(shapes, bucket_bytes, seed):
    gen = torch.Generator().manual_seed(seed)
    named = [(f"w{i}", _random_tensor(tuple(shape), DTYPES[d], gen)) for i, (shape, d) in enumerate(shapes)]
    plan = BucketPlan.for_tensors(named, bucket_bytes)
    assert plan.num_tensors == len(named)
    for size, slots in zip(plan.sizes, plan.buckets):
        assert slots, "no bucket is empty"
        assert size <= bucket_bytes, "a tensor larger than a bucket is split, never a bigger bucket"
        assert all(s.offset % ALIGN == 0 for s in slots)
    plan = BucketPlan.from_wire(plan.to_wire())  # the plan survives its wire form
    got, assembly = [], Assembly()
    for slots, bucket in zip(plan.buckets, pack(plan, named)):
        for name, view in unpack(slots, bucket, assembly):
            whole = dict(named)[name].numel() * dict(named)[name].element_size() <= bucket_bytes
            assert whole == (view.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr()), \
                "unpack copied a whole tensor, or handed out a split one from a bucket"
            got.append((name, view))
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, got):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


def test_large_tensor_is_split_over_buckets_and_bf16_fp32_mix():
    """The worked example of pipeline/weights/bucket_plan.py."""
    named = [("a", torch.randn(100)), ("b", torch.randn(300).bfloat16()),
             ("c", torch.randn(1000)), ("d", torch.randn(10))]
    plan = BucketPlan.for_tensors(named, 2048)
    assert [[s.name for s in b] for b in plan.buckets] == [["a", "b"], ["c"], ["c", "d"]]
    assert plan.buckets[0][1].offset == 448 and plan.sizes == (1048, 2048, 2024)
    assert [(s.part_start, s.part_bytes) for s in (plan.buckets[1][0], plan.buckets[2][0])] == [(0, 2048), (2048, 1952)]
    assert plan.buckets[2][1].offset == 1984 and plan.num_tensors == 4
    assert len(BucketPlan.for_tensors(named, 1024).sizes) == 6
    assembly = Assembly()
    out = dict(kv for slots, buf in zip(plan.buckets, pack(plan, named)) for kv in unpack(slots, buf, assembly))
    assert assembly.allocated == 4000
    with pytest.raises(BucketError, match="needs an Assembly"):
        list(unpack(plan.buckets[1], next(iter(pack(plan, [named[2]], indices=[1])))))
    assert out["b"].dtype == torch.bfloat16 and torch.equal(out["b"], named[1][1])
    assert torch.equal(out["c"], named[2][1])



def test_a_fused_module_that_fits_a_bucket_is_not_cut_by_a_bucket_boundary():
    """The fused-module example of pipeline/weights/bucket_plan.py, and a real layer's names: q/k/v and
    gate/up (with biases) each start a new bucket rather than straddle one, unless they are larger
    than a bucket (then they are cut as any tensors are)."""
    from pipeline.weights.bucket_plan import fused_module

    assert fused_module("model.layers.0.self_attn.k_proj.bias") == "model.layers.0.self_attn.qkv"
    assert fused_module("model.layers.0.mlp.experts.3.up_proj.weight") == "model.layers.0.mlp.experts.3.gate_up"
    assert fused_module("model.layers.0.block_sparse_moe.experts.1.w3.weight") == \
        "model.layers.0.block_sparse_moe.experts.1.w13"
    assert fused_module("model.layers.0.self_attn.o_proj.weight") == "model.layers.0.self_attn.o_proj"
    specs = [("x.norm.weight", "float32", [100])] + [(f"x.{p}_proj.weight", "bfloat16", [300]) for p in "qkv"]
    plan = BucketPlan.from_specs(specs, 2048)
    assert [[(s.name, s.offset) for s in b] for b in plan.buckets] == \
        [[("x.norm.weight", 0)], [("x.q_proj.weight", 0), ("x.k_proj.weight", 640), ("x.v_proj.weight", 1280)]]
    # without the fused names the same bytes fill buckets greedily: q and k join the norm
    plain = BucketPlan.from_specs([("n", "float32", [100])] + [(p, "bfloat16", [300]) for p in "qkv"], 2048)
    assert [[s.name for s in b] for b in plain.buckets] == [["n", "q", "k"], ["v"]]
    layer = [("l.input_layernorm.weight", "bfloat16", [64]), ("l.self_attn.q_proj.weight", "bfloat16", [64, 64]),
             ("l.self_attn.q_proj.bias", "bfloat16", [64]), ("l.self_attn.k_proj.weight", "bfloat16", [32, 64]),
             ("l.self_attn.k_proj.bias", "bfloat16", [32]), ("l.self_attn.v_proj.weight", "bfloat16", [32, 64]),
             ("l.self_attn.v_proj.bias", "bfloat16", [32]), ("l.self_attn.o_proj.weight", "bfloat16", [64, 64]),
             ("l.mlp.gate_proj.weight", "bfloat16", [96, 64]), ("l.mlp.up_proj.weight", "bfloat16", [96, 64]),
             ("l.mlp.down_proj.weight", "bfloat16", [64, 96])]
    for bucket_bytes in range(16640, 40000, 997):  # q/k/v with biases: 16640 B
        plan = BucketPlan.from_specs(layer, bucket_bytes)
        where = {s.name: i for i, b in enumerate(plan.buckets) for s in b}
        assert len({where[n] for n, *_ in layer[1:7]}) == 1, (bucket_bytes, plan.buckets)  # q/k/v with biases
        if bucket_bytes >= 2 * 12288:  # gate and up fit one bucket
            assert where["l.mlp.gate_proj.weight"] == where["l.mlp.up_proj.weight"], bucket_bytes
    # q/k/v larger than a bucket: cut where they overflow, no tensor split
    cut = BucketPlan.from_specs(layer[1:7], 12000)
    assert len(cut.sizes) > 1 and not any(s.is_piece for b in cut.buckets for s in b)

def test_a_large_tensor_is_sent_from_its_own_memory_and_only_small_ones_are_packed(monkeypatch):
    """borrow, with ALONE_BYTES = 1024 on the worked example: c's two pieces travel as segments of
    c's own memory; a and b are packed into bucket 0's buffer, d into bucket 2's (the padding
    between c's last piece and d is not sent). A receiver that puts each segment at its offset
    (bucket 1 straight into c's reassembly memory) unpacks every tensor exactly."""
    from pipeline.weights import buckets

    monkeypatch.setattr(buckets, "ALONE_BYTES", 1024)
    named = [("a", torch.randn(100)), ("b", torch.randn(300).bfloat16()),
             ("c", torch.randn(1000)), ("d", torch.randn(10))]
    plan = BucketPlan.for_tensors(named, 2048)
    segs = [buckets.segments(b, n) for b, n in zip(plan.buckets, plan.sizes)]
    assert segs == [[(0, 1048, None)], [(0, 2048, 0)], [(0, 1952, 0), (1984, 2024, None)]]
    c = named[2][1]
    ring = buckets.BufferRing()
    sent = []
    for pieces in pack(plan, named, buffers=ring, borrow=True):
        sent.append([(t.data_ptr(), t.clone()) for t in pieces])  # buffer views last two buckets
    assert [p for p, _ in sent[1]] == [c.data_ptr()] and sent[2][0][0] == c.data_ptr() + 2048
    assert sent[0][0][0] == ring.get(0, 1).data_ptr() and sent[2][1][0] == ring.get(0, 1).data_ptr() + 1984
    assembly = Assembly()
    got = []
    for slots, size, bucket_segs, pieces in zip(plan.buckets, plan.sizes, segs, sent):
        piece = buckets.lone(slots, size)
        into = assembly.target(piece, "cpu") if piece is not None and piece.is_piece else torch.zeros(size, dtype=torch.uint8)
        for (start, end, _), (_, t) in zip(bucket_segs, pieces):
            into[start:end].copy_(t)  # (the broadcasts)
        got += list(unpack(slots, into, assembly))
    assert [n for n, _ in got] == ["a", "b", "c", "d"] and assembly.allocated == 4000
    assert all(torch.equal(t, dict(named)[n]) for n, t in got)
    with pytest.raises(BucketError, match="arrived before its first"):
        Assembly().add(plan.buckets[2][0], torch.zeros(1952, dtype=torch.uint8))


def test_pack_rejects_tensors_that_differ_from_the_plan():
    plan = BucketPlan.for_tensors([("a", torch.zeros(4))], 1024)
    with pytest.raises(BucketError, match="does not match"):
        list(pack(plan, [("a", torch.zeros(5))]))
    with pytest.raises(BucketError, match="not in the bucket plan"):
        list(pack(plan, [("a", torch.zeros(4)), ("b", torch.zeros(1))]))
    with pytest.raises(BucketError, match="twice"):
        BucketPlan.for_tensors([("a", torch.zeros(1)), ("a", torch.zeros(1))], 1024)
    with pytest.raises(BucketError, match="does not fit"):
        BucketPlan.from_wire([[8, 0, [["a", "float32", [4], 0]]]])



SENDER = textwrap.dedent("""
    import os, sys, torch
    from pipeline.weights.group import TorchDistChannel
    from pipeline.weights.bucket_plan import BucketPlan
    from pipeline.weights.buckets import pack
    port, die_after = int(sys.argv[1]), int(sys.argv[2])
    ch = TorchDistChannel("127.0.0.1", port, 0, 2, timeout_s=60, secret=bytes(32))
    gen = torch.Generator().manual_seed(7)
    named = [("big", torch.randn(5000, generator=gen)), ("bf", torch.randn(33, 7, generator=gen).bfloat16()),
             ("i", torch.arange(10))]
    for version in (3, 4):
        plan = BucketPlan.for_tensors(named, 4096)
        tensors = named
        if die_after >= 0:
            def dying(ts):
                for k, t in enumerate(ts):
                    if k == die_after:  # tensor k opens bucket k here: die before it is sent
                        os._exit(0)
                    yield t
            tensors = dying(named)
        ch.send_stream(version, plan, tensors)
        named = [(n, t * 2 if t.dtype.is_floating_point else t + 1) for n, t in named]
    ch.close()
""")


def _start_sender(port: int, die_after: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SENDER, str(port), str(die_after)])


def test_gloo_channel_carries_versions_between_processes():
    port = free_port("127.0.0.1")
    proc = _start_sender(port, -1)
    try:
        ch = TorchDistChannel("127.0.0.1", port, 1, 2, timeout_s=60, secret=bytes(32))
        gen = torch.Generator().manual_seed(7)
        expected = {"big": torch.randn(5000, generator=gen), "bf": torch.randn(33, 7, generator=gen).bfloat16(),
                    "i": torch.arange(10)}
        for version in (3, 4):
            update = ch.receive()
            assert update.version == version
            assert len(update.plan.sizes) == 6, "the 20 kB tensor is split over five 4 kB buckets"
            got = {n: t.clone() for n, t in update}
            assert got.keys() == expected.keys()
            for n in expected:
                assert torch.equal(got[n], expected[n]), n
            expected = {n: t * 2 if t.dtype.is_floating_point else t + 1 for n, t in expected.items()}
        ch.close()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_sender_dying_mid_broadcast_raises_within_timeout():
    port = free_port("127.0.0.1")
    proc = _start_sender(port, 1)  # sends metadata and the buckets of "big", dies packing bucket 5
    try:
        ch = TorchDistChannel("127.0.0.1", port, 1, 2, timeout_s=30, secret=bytes(32))
        update = ch.receive()
        # No hang: the error arrives (peer reset, or at the latest the 30 s timeout) and names the step.
        # bucket 4 was in flight (streamed: packing bucket 5 overlaps it) when the sender died
        with pytest.raises(WeightSyncError, match="bucket [45]/6 of version 3"):
            for _ in update:
                pass
        ch.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)


SPLIT_SENDER = textwrap.dedent("""
    import sys, torch
    from pipeline.weights import buckets
    from pipeline.weights.bucket_plan import BucketPlan
    from pipeline.weights.group import TorchDistChannel
    port, bucket = int(sys.argv[1]), int(sys.argv[2])
    buckets.ALONE_BYTES = 4096  # the embedding's pieces travel from its own memory, the rest packed
    ch = TorchDistChannel("127.0.0.1", port, 0, 2, timeout_s=60, secret=bytes(32))
    gen = torch.Generator().manual_seed(11)
    big = torch.randn(5 * bucket // 8, generator=gen)  # float32: 2.5 buckets
    named = [("small", torch.arange(7)), ("embed", big), ("tail", torch.randn(3, generator=gen).bfloat16())]
    for version in (1, 2, 3):  # received streamed, streamed, then staged
        named_v = [(n, t * version if n == "embed" else t) for n, t in named]
        ch.send_stream(version, BucketPlan.for_tensors(named_v, bucket), named_v)
    print(ch.buffers.allocated, ch.wire.sent, ch.wire.received, flush=True)
    ch.close()
""")


def test_a_tensor_of_two_and_a_half_buckets_round_trips_within_two_buckets_of_buffers(monkeypatch):
    """Streamed and staged receives of a tensor split over three buckets: exact bytes, and the bytes
    both ends counted on the wire are the tensors' and the metadata's; the counted buffers of either end stay within two buckets; the reassembly costs the
    tensor's own size, once: a second streamed update reassembles in the first one's memory, a
    staged one in memory of its own. Its pieces travel as segments of their own (ALONE_BYTES)."""
    from pipeline.weights import buckets

    monkeypatch.setattr(buckets, "ALONE_BYTES", 4096)
    bucket, port = 1 << 16, free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-c", SPLIT_SENDER, str(port), str(bucket)],
                            stdout=subprocess.PIPE, text=True)
    try:
        ch = TorchDistChannel("127.0.0.1", port, 1, 2, timeout_s=60, secret=bytes(32))
        gen = torch.Generator().manual_seed(11)
        big = torch.randn(5 * bucket // 8, generator=gen)
        want = {"small": torch.arange(7), "embed": big, "tail": torch.randn(3, generator=gen).bfloat16()}
        embed_memory, received = [], 0
        for version, stage in ((1, False), (2, False), (3, True)):
            before = ch.wire.reading()
            update = ch.receive(stage=stage)
            assert [[(s.name, s.part_start) for s in b] for b in update.plan.buckets] == \
                [[("small", 0)], [("embed", 0)], [("embed", bucket)], [("embed", 2 * bucket), ("tail", 0)]]
            got = {}
            for n, t in update:  # streamed views last until the bucket after next: cloned at once
                got[n] = t.clone()
                if n == "embed":
                    embed_memory.append(t.data_ptr())
            want["embed"] = big * version
            assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
            # counted at the receiver: the tensors' bytes (no padding falls inside a packed run
            # here) and the metadata (its length, int64, then the `UpdateHeader` record)
            meta = codec.pack(weight_stream.UpdateHeader(version, update.plan.to_wire()))
            counted = ch.wire.since(before)
            assert counted.received == 8 + len(meta) + sum(t.numel() * t.element_size() for t in want.values())
            assert counted.sent == 0
            received += counted.received
            assert update.assembly.allocated == (0 if version == 2 else big.numel() * 4)
        assert embed_memory[1] == embed_memory[0] != embed_memory[2]
        assert ch.buffers.allocated <= 2 * bucket  # the streamed receives; staged buckets are kept by design
        ch.close()
        allocated, sent, sender_received = map(int, proc.stdout.readline().split())
        assert 0 < allocated <= 2 * bucket, f"the sender allocated {allocated} B of buffers for {bucket} B buckets"
        assert (sent, sender_received) == (received, 0), "the two ends counted different bytes"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_joining_a_group_nobody_hosts_fails_clearly():
    with pytest.raises(WeightSyncError, match="could not join the weight group"):
        TorchDistChannel("127.0.0.1", free_port("127.0.0.1"), 1, 2, timeout_s=2, secret=bytes(32))


@pytest.mark.gpu
def test_buckets_pack_and_unpack_on_cuda():
    gen = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(1000, 33, generator=gen).bfloat16().cuda()), ("b", torch.randn(7, generator=gen).cuda()),
             ("c", torch.randn(300_000, generator=gen).cuda())]
    plan = BucketPlan.for_tensors(named, 1 << 20)
    buckets = list(pack(plan, named))
    assert all(b.is_cuda for b in buckets) and len(buckets) == 2
    out = dict(kv for slots, b in zip(plan.buckets, buckets) for kv in unpack(slots, b))
    for n, t in named:
        assert out[n].is_cuda and torch.equal(out[n], t)


def test_a_change_of_source_closes_the_bucket_and_survives_the_wire():
    specs = [("a", "float32", (10,), 0), ("b", "float32", (10,), 1), ("c", "float32", (10,), 1),
             ("d", "float32", (10,), 0)]
    plan = BucketPlan.from_wire(BucketPlan.from_specs(specs, 1 << 20).to_wire())
    assert [[s.name for s in b] for b in plan.buckets] == [["a"], ["b", "c"], ["d"]]
    assert plan.sources == (0, 1, 0) and plan.of_source(0) == [0, 2] and plan.of_source(1) == [1]


def test_a_buffer_ring_of_two_allocates_two_buckets_at_most():
    from pipeline.weights.buckets import BufferRing

    named = [(f"w{i}", torch.full((100 + 50 * (i % 3),), float(i))) for i in range(12)]
    plan = BucketPlan.for_tensors(named, 1024)
    buffers = BufferRing()
    seen = []
    for slots, bucket in zip(plan.buckets, pack(plan, named, buffers=buffers)):
        seen += [(n, t.clone()) for n, t in unpack(slots, bucket)]  # consumed before bucket k + 2 exists
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, seen)) and len(seen) == len(named)
    assert len(plan.sizes) > 2 and buffers.allocated <= 2 * max(plan.sizes)


MULTI_SENDER = textwrap.dedent("""
    import sys, torch
    from pipeline.weights.bucket_plan import BucketPlan
    from pipeline.weights.group import TorchDistChannel
    port, source = int(sys.argv[1]), int(sys.argv[2])
    specs = [(f"t{i}", "float32", (256 * (1 + i % 3),), (i // 4) % 2) for i in range(16)]
    plan = BucketPlan.from_specs(specs, 2048)
    ch = TorchDistChannel("127.0.0.1", port, source, 4, timeout_s=30, senders=2, secret=bytes(32))
    for version in (1, 2):
        named = [(n, torch.full(shape, float(version * 100 + i))) for i, (n, _, shape, src) in enumerate(specs)
                 if src == source]
        ch.send_stream(version, plan, iter(named))
        assert ch.buffers.allocated <= 2 * max(plan.sizes), ch.buffers.allocated
    ch.close()
""")


def test_two_senders_stream_their_own_buckets_to_every_receiver():
    """Sender 0 and sender 1 each send only their tensors; both receivers get all of them, in plan
    order, in two streaming buffers."""
    port = free_port("127.0.0.1")
    senders = [subprocess.Popen([sys.executable, "-c", MULTI_SENDER, str(port), str(s)]) for s in (0, 1)]
    other = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from pipeline.weights.group import TorchDistChannel
        ch = TorchDistChannel("127.0.0.1", int(sys.argv[1]), 3, 4, timeout_s=30, senders=2, secret=bytes(32))
        for _ in (1, 2):
            assert sum(1 for _ in ch.receive()) == 16
        ch.close()
    """), str(port)])
    try:
        ch = TorchDistChannel("127.0.0.1", port, 2, 4, timeout_s=30, senders=2, secret=bytes(32))
        for version in (1, 2):
            update = ch.receive()
            assert update.version == version and set(update.plan.sources) == {0, 1}
            got = [(n, float(t[0]), t.numel(), bool((t == t[0]).all())) for n, t in update]
            assert got == [(f"t{i}", float(version * 100 + i), 256 * (1 + i % 3), True) for i in range(16)]
        assert ch.buffers.allocated <= 2 * max(update.plan.sizes)
        ch.close()
        assert [p.wait(timeout=30) for p in (*senders, other)] == [0, 0, 0]
    finally:
        for p in (*senders, other):
            p.kill()


STREAM_SENDER = textwrap.dedent("""
    import sys, torch
    from pipeline.weights.group import TorchDistChannel
    ch = TorchDistChannel("127.0.0.1", int(sys.argv[1]), 0, 2, timeout_s=30, secret=bytes(32))
    ch.send_tensors(1, [(f"w{i}", torch.full((1024,), float(i))) for i in range(8)], bucket_bytes=4096)
    ch.close()
""")


def test_a_streamed_receive_copies_what_its_consumer_still_holds_before_reusing_a_buffer():
    """Two receive buffers: bucket k+1 arrives while bucket k is loaded, into the buffer of bucket
    k-1. A consumer that keeps views longer (vLLM's layerwise reload holds a module's tensors until
    the module is complete) passes ``release``, called with each buffer before its reuse: what it
    copies there stays intact, counted in ``carried``. The receiver dawdles on each bucket (as a
    slow load would) and waits for bucket k+1 to land before asking for it, so a reuse without the
    copy would have overwritten a held tensor."""
    import time

    held: dict[str, torch.Tensor] = {}  # every tensor received, as views until released

    def release(buffer: torch.Tensor) -> int:
        start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
        copied = 0
        for name, t in held.items():
            if start <= t.data_ptr() < end:
                held[name] = t.clone()
                copied += t.numel() * t.element_size()
        return copied

    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-c", STREAM_SENDER, str(port)])
    try:
        ch = TorchDistChannel("127.0.0.1", port, 1, 2, timeout_s=30, secret=bytes(32))
        update = ch.receive(release=release)
        count = len(update.plan.sizes)
        assert count == 8, "one 4 kB tensor per 4 kB bucket"
        for i, (name, t) in enumerate(update):
            time.sleep(0.05)
            assert name == f"w{i}" and bool((t == i).all())
            held[name] = t
            if i + 1 < count:  # bucket i + 1 lands while bucket i is held
                following = ch.buffers.get(i + 1, update.plan.sizes[i + 1]).view(torch.float32)
                deadline = time.monotonic() + 30
                while not bool((following == i + 1).all()) and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert bool((following == i + 1).all()), f"bucket {i + 1} did not arrive while bucket {i} was loaded"
        assert [int(held[f"w{i}"][0]) for i in range(count)] == list(range(count))
        assert all(bool((held[f"w{i}"] == i).all()) for i in range(count)), "a held tensor was overwritten"
        # buckets 2..7 each reused the buffer of the bucket before the one being loaded
        assert update.carried == (count - 2) * 4096
        assert ch.buffers.allocated <= 2 * max(update.plan.sizes)
        ch.close()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


IPC_SENDER = textwrap.dedent("""
    import sys, torch
    from pipeline.weights.cuda_ipc import CudaIpcChannel
    ch = CudaIpcChannel("127.0.0.1", int(sys.argv[1]), 0, timeout_s=60, device=torch.device("cuda", 0), secret=bytes(32))
    for version in (1, 2, 3):
        gen = torch.Generator(device="cuda").manual_seed(version)
        named = [(f"w{i}", torch.randn(3000 + 700 * i, device="cuda", generator=gen).to(
                 torch.bfloat16 if i % 2 else torch.float32)) for i in range(9)]
        ch.send_tensors(version, named, bucket_bytes=1 << 14)
        assert ch.buffers.allocated <= 2 * (1 << 14), ch.buffers.allocated
    print(ch.wire.sent, ch.wire.received, flush=True)
    ch.close()
""")


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [False, True])
def test_cuda_ipc_channel_streams_buckets_to_a_process_on_the_same_gpu(stage):
    """The colocated channel (generator.weight_channel=cuda_ipc): buckets are read in place from
    the sender's two GPU buffers (streamed) or copied out (staged); every tensor arrives intact."""
    from pipeline.weights.cuda_ipc import CudaIpcChannel

    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-c", IPC_SENDER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        ch = CudaIpcChannel("127.0.0.1", port, 1, timeout_s=60, device=torch.device("cuda", 0), secret=bytes(32))
        payload = 0
        for version in (1, 2, 3):
            gen = torch.Generator(device="cuda").manual_seed(version)
            expected = [(f"w{i}", torch.randn(3000 + 700 * i, device="cuda", generator=gen).to(
                         torch.bfloat16 if i % 2 else torch.float32)) for i in range(9)]
            update = ch.receive(stage=stage)
            got = [(n, t.clone()) for n, t in update]
            assert update.version == version and len(update.plan.sizes) > 2
            assert [n for n, _ in got] == [n for n, _ in expected]
            assert all(a.is_cuda and torch.equal(a, b) for (_, a), (_, b) in zip(got, expected))
            payload += sum(update.plan.sizes)
        assert ch.buffers.allocated == 0, "the receiver maps the sender's buffers; it allocates none"
        # counted at both ends: the buckets handed over and every store document (plans, handles,
        # acknowledgements the other way) are counted alike by their sender and their receiver
        sent, received = map(int, proc.stdout.readline().split())
        assert (ch.wire.received, ch.wire.sent) == (sent, received) and received > 0
        assert payload < ch.wire.received < payload + (1 << 16), (payload, ch.wire.received)
        ch.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
