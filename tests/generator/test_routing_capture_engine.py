"""Keep Routing in the generator, on a real vLLM engine (float32) compiled as a checkpoint is by default
(enforce_eager off: on this CPU build, vLLM's V1 runner with Dynamo + inductor), so the recorder
hook runs inside the compiled graph (pipeline/generator/engine_plan.py; the eager hook runs in
tests/test_routing_run.py):

- the routing recorded for every position of a sample (prompt included) equals what transformers'
  model routes the same tokens to in the engine's dtype;
- after a ``keep``-mode weight update mid-generation, every position carries the routing of the
  NEW weights (the update drops the KV and the engine recomputes the whole prefix: last
  computation wins, routing_capture.py), although the early tokens were sampled by the old ones.

Positions whose k-th and (k+1)-th router probabilities are within 1e-5 (a near-tie either side
may break differently) are left out and counted."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from support.routing import compare

pytestmark = pytest.mark.engine
PROMPTS = [[0, 17, 30, 41, 9], [0, 55, 12, 200], [0, 3, 4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from pipeline.generator.config import GeneratorConfig
    from pipeline.generator.engine import Generator
    from support.oracle import sharpened_checkpoint

    root = tmp_path_factory.mktemp("routing")
    dirs = {1: sharpened_checkpoint("moe", root / "v1", seed=7), 2: sharpened_checkpoint("moe", root / "v2", seed=8)}
    cfg = GeneratorConfig(model=str(dirs[1]), max_model_len=512, max_tokens=12, enforce_eager=False,
                          dtype="float32", kv_cache_gib=1, max_num_seqs=16, seed=5, record_routing=True)
    loop = asyncio.new_event_loop()
    gen = loop.run_until_complete(Generator(cfg, initial_version=1).start())
    assert (gen.plan.runner, gen.plan.compilation, gen.plan.routing_capture) == ("v1", "torch.compile", "hook")
    yield gen, loop, dirs
    gen.shutdown()
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def test_recorded_routing_equals_transformers_in_the_engine_dtype(engine):
    gen, loop, dirs = engine

    async def run():
        return await asyncio.gather(*(gen.complete(p, lambda seg, i=i: 100 + i) for i, p in enumerate(PROMPTS)))
    done = loop.run_until_complete(run())
    sequences = [p + c.token_ids[:-1] for p, c in zip(PROMPTS, done)]
    compared, ties, differ = compare(dirs[1], sequences, [c.routed_experts for c in done])
    print(f"\nrouting compared at {compared} (position, layer) pairs, {ties} near-ties left out; "
          f"{2 * gen.routing_shape[0] * gen.routing_shape[1]} bytes per token as int16")
    assert differ == 0 and compared > 10 * max(ties, 1)


def test_a_keep_update_leaves_every_position_with_the_new_weights_routing(engine):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    gen, loop, dirs = engine
    gen.config.max_tokens, gen.config.ignore_eos, gen.config.interrupt = 150, True, "keep"

    async def run():
        started = asyncio.Event()

        async def watch():  # decoded in the same batches: once it has 40 tokens, so has the sample
            params = SamplingParams(max_tokens=150, ignore_eos=True, detokenize=False,
                                    output_kind=RequestOutputKind.DELTA)
            n = 0
            async for out in gen.engine.generate({"prompt_token_ids": PROMPTS[2]}, params, "watch"):
                n += len(out.outputs[0].token_ids)
                if n >= 40:
                    started.set()
        watcher = asyncio.ensure_future(watch())
        task = asyncio.ensure_future(gen.complete(PROMPTS[0], lambda seg: 11))
        await started.wait()
        await gen.update_weights(2, path=str(dirs[2]))
        await watcher
        return await task
    try:
        c = loop.run_until_complete(run())
    finally:
        gen.config.max_tokens, gen.config.ignore_eos = 12, False
    k = c.versions.count(1)
    assert 0 < k < len(c.token_ids), f"the update did not land mid-generation ({k} old tokens)"
    sequence = [PROMPTS[0] + c.token_ids[:-1]]
    compared, ties, differ = compare(dirs[2], sequence, [c.routed_experts])
    _, _, differ_old = compare(dirs[1], [sequence[0][:len(PROMPTS[0]) + k]], [c.routed_experts[:len(PROMPTS[0]) + k]])
    print(f"\nafter the update at token {k}: {differ} of {compared} (position, layer) pairs differ from "
          f"the new weights' routing; the old weights' routing differs at {differ_old} of the early ones")
    assert differ == 0 and compared > 10 * max(ties, 1)
    assert differ_old > 0  # the old weights would have routed the early positions otherwise

