"""The built-in demo learns with LoRA (slow: a full `tokenflow train`, several minutes on 2 cores).

Adapters of rank 16 on every attention and expert projection of the tiny MoE model, base frozen,
adapter-only weight sync merged by the generator. Held-out greedy accuracy (the orchestrator's
evaluations) must rise by at least 30 points within 12 minutes of training.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pipeline.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.engine]

LORA = ["trainer.lora.rank=16", "trainer.lora.alpha=32", "trainer.lr=2e-3"]
BUDGET_S = 12 * 60


def test_demo_learns_with_lora(tmp_path):
    run = tmp_path / "lora"
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "run.name=lora", f"hydra.run.dir={run}",
           "run.progress=false", "logger=[]", "run.eval_every=10", *LORA]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=BUDGET_S + 300,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.monotonic() - t0
    assert out.returncode == 0, f"train failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    evals = sorted(read_metrics(run, "eval"), key=lambda e: e["step"])
    steps = list(read_metrics(run, "train_step"))
    curve = ", ".join(f"{e['step']}: {e['accuracy']:.2f}" for e in evals)
    print(f"\nLoRA demo: held-out accuracy by step {curve}; wall {wall:.0f} s; trainable parameters "
          f"{steps[-1]['trainable_params']:.0f}; {steps[-1]['sync_bytes'] / 2**10:.0f} KiB per sync, "
          f"median sync {sorted(s['sync_s'] for s in steps)[len(steps) // 2] * 1e3:.0f} ms")
    assert wall <= BUDGET_S, f"the run took {wall:.0f} s"
    assert max(e["accuracy"] for e in evals[1:]) - evals[0]["accuracy"] >= 0.30, curve
    assert (run / "export").exists() and list((run / "export").glob("step-*/adapter_config.json"))
