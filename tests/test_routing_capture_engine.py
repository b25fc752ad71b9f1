"""Keep Routing in the generator: the routing a real vLLM engine records for every position of a
sample (prompt included) equals what transformers' model routes the same tokens to, in the
engine's dtype (float32 here). Positions whose k-th and (k+1)-th router probabilities are within
1e-5 (a near-tie either side may break differently) are left out and counted."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytestmark = pytest.mark.engine
TIE = 1e-5


def hf_routing(model_dir, sequences):
    """Per sequence ``[positions, layers, k]`` experts and a ``[positions, layers]`` near-tie flag."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o))
             for layer in model.model.layers]
    out = []
    with torch.no_grad():
        for ids in sequences:
            seen.clear()
            model(torch.tensor([ids]))
            experts = torch.stack([o[2] for o in seen], 1)  # [T, layers, k]
            k = experts.shape[-1]
            probs = torch.stack([torch.softmax(o[0].float(), -1) for o in seen], 1)
            top = probs.topk(k + 1, dim=-1).values
            out.append((experts.numpy(), (top[..., k - 1] - top[..., k] < TIE).numpy()))
    for h in hooks:
        h.remove()
    return out


def test_recorded_routing_equals_transformers_in_the_engine_dtype(tmp_path):
    from pipeline.generator.config import GeneratorConfig
    from pipeline.generator.engine import Generator
    from pipeline.trainer.oracle import sharpened_checkpoint

    model_dir = sharpened_checkpoint("moe", tmp_path / "model")
    cfg = GeneratorConfig(model=str(model_dir), max_model_len=256, max_tokens=12, enforce_eager=True,
                          dtype="float32", kv_cache_gib=1, max_num_seqs=16, seed=5, prefix_caching=False,
                          record_routing=True)
    prompts = [[0, 17, 30, 41, 9], [0, 55, 12, 200], [0, 3, 4, 5, 6, 7, 8]]
    gen = Generator(cfg)

    async def run():
        await gen.start()
        try:
            return await asyncio.gather(*(gen.complete(p, lambda seg, i=i: 100 + i)
                                          for i, p in enumerate(prompts)))
        finally:
            gen.shutdown()
    done = asyncio.run(run())
    sequences = [p + c.token_ids[:-1] for p, c in zip(prompts, done)]
    compared = ties = 0
    for seq, c, (want, tie) in zip(sequences, done, hf_routing(model_dir, sequences)):
        got = c.routed_experts
        assert got.shape == want.shape == (len(seq), *gen.routing_shape)
        assert got.min() >= 0, "a position the request ran has no recorded routing"
        same = (np.sort(got, -1) == np.sort(want, -1)).all(-1)  # [positions, layers]
        assert same[~tie].all(), f"routing differs at (position, layer) {np.argwhere(~same & ~tie)[:5]}"
        compared += int((~tie).sum())
        ties += int(tie.sum())
    print(f"\nrouting compared at {compared} (position, layer) pairs, {ties} near-ties left out; "
          f"{2 * gen.routing_shape[0] * gen.routing_shape[1]} bytes per token as int16")
    assert compared > 10 * max(ties, 1)
