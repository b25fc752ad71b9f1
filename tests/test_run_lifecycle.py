"""No run outlives its command, none waits on nothing: `tokenflow train` end to end.

- SIGTERM to `tokenflow train` mid-run stops the whole run as `tokenflow cancel` does: the trainer
  checkpoints at its step boundary, the command exits 128 + 15, and 10 s later no process of the
  run is left (the test's marker, inherited by every process the run starts, engines included).
  Before, the launcher died alone and the run trained on by itself.
- A run whose only generator can never serve (a checkpoint vLLM's CPU attention refuses: head_dim
  16, it supports 32-512) and has no restart left is abandoned by its supervisor; the trainer,
  waiting for a batch, fails the run naming the cause instead of waiting ``run.timeout_s``.

Real engines, trainer and launcher; tiny models, few steps.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chaos import last_step, wait_for
from pipeline.supervise import MARKER_ENV, leftovers

pytestmark = pytest.mark.engine
REPO = Path(__file__).resolve().parents[1]
TINY = ["run.eval_every=0", "run.mismatch_every=0", "run.progress=false", "run.tensorboard=false",
        "orchestrator.groups_per_step=2", "orchestrator.group_size=4", "model.warmstart_steps=0",
        "generator.max_tokens=16"]


def start_train(run: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", f"run.name={run.name}",
                             f"hydra.run.dir={run}", *TINY, *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_sigterm_to_train_stops_the_whole_run_with_a_checkpoint(tmp_path):
    """86 s on a busy 2-core machine (one engine start, a few steps)."""
    run = tmp_path / "sig"
    proc = start_train(run, "run.steps=500", "run.checkpoint_every=1000", "run.timeout_s=300")
    try:
        wait_for(lambda: last_step(run) >= 1, 600, "two trained steps", lambda: proc.poll() is None)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM received; stopping the run" in out, out[-3000:]
    left = leftovers(os.environ[MARKER_ENV], wait_s=10.0)  # ended (killed) if found: the test fails
    assert not left, f"processes of the run still alive 10 s after `tokenflow train` returned: {left}"
    done = [int(d.name.split("-")[1]) for d in (run / "checkpoints").glob("step-*") if (d / "COMPLETE").exists()]
    assert done and max(done) >= 2, f"no checkpoint of the stopped run: {sorted(done)}\n{out[-3000:]}"
    assert max(done) <= last_step(run) + 1  # the steps trained before the stop, nothing invented


@pytest.mark.slow  # 162 s on a busy 2-core machine: the broken engine fails only in its first generation
def test_a_run_whose_generators_are_all_abandoned_fails_naming_the_cause(tmp_path):
    from pipeline.models.tiny import TinyModelSpec, ensure_tiny_model

    model = ensure_tiny_model(spec=TinyModelSpec(kind="dense", hidden_size=64, num_heads=4, num_kv_heads=2,
                                                 head_dim=16))
    run = tmp_path / "abandoned"
    t0 = time.monotonic()
    # run.timeout_s is far beyond what the test waits: the run must end on the fact, not the timeout
    proc = start_train(run, "run.steps=3", f"model.name={model}", "cluster.generator.max_restarts=0",
                       "run.timeout_s=3600")
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - t0
    assert proc.returncode == 1, out[-3000:]
    assert "no generator is left to train on" in out, out[-5000:]
    assert took < 3600 / 4, took  # far from the timeout: it ended on the abandonment
