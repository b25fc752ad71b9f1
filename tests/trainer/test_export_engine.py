"""A trained policy's Hugging Face export starts a fresh vLLM engine and is the policy transformers sees.

The chain a user follows after a run, on the 8-expert tiny MoE (sharpened weights, float32):
1. a one-rank trainer (megatron-core, gloo) takes two optimizer steps and writes a trainer
   checkpoint into a run directory and a live export (the end-of-run path, ``Trainer.export_hf``);
   a new trainer started from that export gives the trained one's logprobs exactly;
2. ``tokenflow export RUN --step 2`` (``pipeline.apps.export.main``) converts the checkpoint into
   ``RUN/export/step-2/``; it equals the live export bit for bit and ``validate`` accepts it as
   ``model.name`` (a checkpoint: no warm-start);
3. a fresh vLLM engine, through the project's generator driver, starts on that directory alone
   (weights, config, tokenizer and generation config all from it) and answers greedy requests for
   prompts tokenized by the exported tokenizer;
4. the oracle is transformers on the same directory: its greedy continuations equal vLLM's token
   for token (EOS stops both), and vLLM's logprob of every generated token equals transformers'
   within ``VLLM_LOGPROB_TOL`` (the error is printed).
One trainer process (two trainers, one after the other) and one engine: ~56 s alone on 2 cores.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support.oracle import hf_logprobs, make_samples, sharpened_checkpoint

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
MAX_TOKENS = 16
VLLM_LOGPROB_TOL = 1e-4  # vLLM (its own CPU kernels) vs transformers, float32, per generated token
# (measured 3.8e-6; a flipped expert choice or a wrong weight shows as >= 1e-2)
TEXTS = ["sort: 3 1 2", "sort: 9 4 7 5 1", "add: 12 + 30 =", "Hello, world"]


def _train_and_checkpoint(run: Path, model_dir: str) -> None:
    """In a fresh process: STEPS optimizer steps, a trainer checkpoint, a live export; then a new
    trainer started from the export (as ``model.name``) and its logprobs against the trained one's."""
    from pipeline.run_files import CHECKPOINTS_DIR, checkpoint_name
    from pipeline.trainer.config import TrainerConfig
    from pipeline.trainer.engine import Trainer

    def start(directory, name):
        return Trainer(TrainerConfig(model_dir=str(directory), lr=1e-3, grad_clip=0.0, micro_batch_tokens=96),
                       rank=0, world_size=1, init_method=f"file://{run}/{name}")

    trainer = start(model_dir, "pg-train")
    samples = make_samples(3, 8, trainer.hf_config.vocab_size)
    rng = np.random.default_rng(1)
    for s, lp in zip(samples, trainer.logprobs(samples)):
        s.behaviour_logprobs = (lp + rng.normal(0, 0.1, len(lp))).astype(np.float32)
    for _ in range(STEPS):
        trainer.train_step(samples)
    trained = trainer.logprobs(samples)
    trainer.save(run / CHECKPOINTS_DIR / checkpoint_name(STEPS))
    trainer.export_hf(run / "live-export")
    trainer.close()
    restarted = start(run / "live-export", "pg-restart")
    err = max(float(np.abs(a - b).max()) for a, b in zip(trained, restarted.logprobs(samples)))
    restarted.close()
    (run / "restart.json").write_text(json.dumps({"max_logprob_diff": err}))


def _tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations (its own generation loop and the export's generation config)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_TOKENS)
            out.append(ids[0, len(p):].tolist())
    return out


async def _vllm_greedy(model_dir: Path, prompts: list[list[int]]):
    from pipeline.generator.config import GeneratorConfig
    from pipeline.generator.engine import Generator

    cfg = GeneratorConfig(model=str(model_dir), max_model_len=256, max_tokens=MAX_TOKENS, enforce_eager=True,
                          dtype="float32", kv_cache_gib=1, max_num_seqs=8, seed=1234)
    gen = await Generator(cfg, generator_id=0, initial_version=STEPS).start()
    try:
        return await gen.evaluate(prompts)
    finally:
        gen.shutdown()


def test_export_of_a_trained_moe_serves_in_a_fresh_vllm_engine(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.apps.export import main as export_main
    from pipeline.config import TokenflowConfig, validate
    from pipeline.models.tiny import resolve_model
    from pipeline.run_dir import publish_model
    from pipeline.trainer.layout import TrainSample

    source = sharpened_checkpoint("moe8", tmp_path / "source")
    run = tmp_path / "run"
    run.mkdir()
    publish_model(run, source)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}",
               PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, __file__, str(run), str(source)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    assert export_main([str(run), "--step", str(STEPS)]) == 0
    export = run / "export" / f"step-{STEPS}"
    offline, live, initial = _tensors(export), _tensors(run / "live-export"), _tensors(source)
    assert set(offline) == set(live) == set(initial)
    assert all(offline[k].equal(live[k]) for k in offline), "offline export differs from the live one"
    moved = max(float((offline[k] - initial[k]).abs().max()) for k in offline)
    assert moved > 0, "the trainer steps did not change the weights"
    assert AutoConfig.from_pretrained(str(export)).num_experts == 8
    restart = json.loads((run / "restart.json").read_text())["max_logprob_diff"]
    assert restart == 0.0, f"a trainer started from the export differs from the trained one by {restart}"
    cfg = TokenflowConfig()
    cfg.model.name = str(export)
    validate(cfg)  # accepted as model.name: a checkpoint (no warm-start), defaults from its config
    assert resolve_model(cfg.model.name) == export.resolve() and cfg.model.warmstart_steps == 0

    tokenizer = AutoTokenizer.from_pretrained(str(export))
    prompts = [tokenizer.encode(t) for t in TEXTS]
    completions = asyncio.run(_vllm_greedy(export, prompts))
    reference = _hf_greedy(export, prompts)
    samples = [TrainSample(p, c.token_ids, c.logprobs) for p, c in zip(prompts, completions)]
    ref_logprobs = hf_logprobs(export, samples)
    err = max(float(np.abs(np.asarray(c.logprobs) - r).max()) for c, r in zip(completions, ref_logprobs))
    trained_away = max(float(np.abs(np.asarray(c.logprobs) - r).max())
                       for c, r in zip(completions, hf_logprobs(source, samples)))
    lengths = [len(c.token_ids) for c in completions]
    print(f"\nexport of a {STEPS}-step trained tiny-moe8 (weights moved up to {moved:.2e}) in a fresh vLLM "
          f"engine: greedy continuations of lengths {lengths} equal transformers': "
          f"{[c.token_ids for c in completions] == reference}; max |vLLM - HF| logprob {err:.2e} "
          f"(tolerance {VLLM_LOGPROB_TOL:g}); the untrained model's differ by up to {trained_away:.2e}")
    for c, ref in zip(completions, reference):
        assert c.token_ids == ref, (c.token_ids, ref)
        assert c.finish_reason in ("stop", "length")
    assert sum(lengths) > len(prompts), "every continuation ended at once: nothing was compared"
    assert err < VLLM_LOGPROB_TOL
    assert trained_away > 10 * VLLM_LOGPROB_TOL, "the oracle cannot tell the trained policy from the initial one"


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    _train_and_checkpoint(Path(sys.argv[1]), sys.argv[2])
