"""Keep Sampling Mask end to end: a real vLLM engine samples with top-k + top-p and records the
kept sets; the megatron-core trainer's logprobs renormalised over them equal the engine's logprobs
of the distribution it sampled (and the full-vocabulary logprobs do not)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.launch.rendezvous import free_port

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
WIDTH, TOP_K, TOP_P = 8, 6, 0.8
LOGPROB_TOL = 1e-3  # as tests/generator/test_generator.py's vLLM-vs-transformers check (float32 both sides)

TRAINER = """
import json, sys, numpy as np, torch
from pipeline.trainer.config import TrainerConfig
from pipeline.trainer.engine import Trainer
from pipeline.trainer.layout import TrainSample
torch.set_num_threads(1)
model_dir, data, out = sys.argv[1:4]
d = np.load(data)
n = int(d["n"])
samples = [TrainSample(d[f"p{i}"], d[f"c{i}"], d[f"lp{i}"], sampling_mask=d[f"m{i}"]) for i in range(n)]
trainer = Trainer(TrainerConfig(model_dir=model_dir, micro_batch_tokens=256))
masked = trainer.logprobs(samples)
for s in samples:
    s.sampling_mask = None
full = trainer.logprobs(samples)
np.savez(out, **{f"masked{i}": masked[i] for i in range(n)}, **{f"full{i}": full[i] for i in range(n)})
trainer.close()
"""


def _generate(model_dir: Path):
    from pipeline.generator.config import GeneratorConfig, GroupRequest
    from pipeline.generator.engine import Generator
    from pipeline.protocol.record import RecordSchema

    cfg = GeneratorConfig(model=str(model_dir), max_model_len=256, max_tokens=16, enforce_eager=True,
                          dtype="float32", kv_cache_gib=1, max_num_seqs=16, seed=77, top_k=TOP_K,
                          top_p=TOP_P, sampling_mask_width=WIDTH)
    gen = Generator(cfg, schema=RecordSchema(sampling_mask_k=WIDTH))

    async def run():
        await gen.start()
        try:
            samples = []
            for g, prompt in enumerate([[0, 17, 30, 41, 9], [0, 55, 12, 200]]):
                samples += await gen.generate_group(GroupRequest(g, g, 0, prompt, 4))
            return samples
        finally:
            gen.shutdown()
    return asyncio.run(run())


def test_trainer_logprobs_under_the_recorded_mask_equal_the_engines(tmp_path):
    from support.oracle import sharpened_checkpoint

    model_dir = sharpened_checkpoint("moe", tmp_path / "model")
    samples = _generate(model_dir)
    sizes = np.concatenate([(s.sampling_mask >= 0).sum(1) for s in samples])
    for s in samples:
        assert s.sampling_mask.shape == (len(s.completion_ids), WIDTH)
        assert all(t in row for t, row in zip(s.completion_ids, s.sampling_mask))
    assert sizes.min() >= 1 and sizes.max() <= TOP_K and sizes.max() > 1
    data = {"n": len(samples)}
    for i, s in enumerate(samples):
        data.update({f"p{i}": s.prompt_ids, f"c{i}": s.completion_ids, f"lp{i}": s.logprobs,
                     f"m{i}": s.sampling_mask})
    np.savez(tmp_path / "samples.npz", **data)
    port = free_port("127.0.0.1")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", TRAINER, str(model_dir), str(tmp_path / "samples.npz"),
                           str(tmp_path / "out.npz")], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    masked_err = max(float(np.abs(out[f"masked{i}"] - s.logprobs).max()) for i, s in enumerate(samples))
    full_gap = float(np.mean(np.concatenate([s.logprobs - out[f"full{i}"] for i, s in enumerate(samples)])))
    print(f"\nkept-set sizes: mean {sizes.mean():.2f}, max {sizes.max()}; max |trainer(masked) - vLLM| "
          f"{masked_err:.2e}; mean vLLM - trainer(full vocabulary) {full_gap:.3f}")
    assert masked_err < LOGPROB_TOL
    assert full_gap > 10 * LOGPROB_TOL  # without the mask the trainer scores another distribution
