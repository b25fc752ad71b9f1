"""Keep Routing in a live run: `tokenflow train` with ``generator.record_routing`` and
``trainer.routing_replay`` on the tiny MoE (real vLLM generator in float32, real megatron trainer).

- the run trains; the rollout log carries routing for every prompt and completion token (the last
  completion token, never fed to the model, has none);
- the recorded routing of the samples of version 0 equals what transformers' model routes the same
  tokens to on the run's initial weights (an independent oracle; near-ties left out, as in
  tests/generator/test_routing_capture_engine.py);
- the trainer's own router agrees with the recorded routing on the positions it replays, prompt
  tokens included (``routing_differ_frac`` of the metrics stream; a synchronous run in float32
  trains on the weights that sampled, so only near-ties may differ).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support.routing import compare

pytestmark = pytest.mark.engine


def test_a_live_run_records_prompt_and_completion_routing_and_replays_it(tmp_path):
    from pipeline.rollout_log.reader import RolloutLog
    from pipeline.metrics import read_metrics
    from pipeline.protocol.record import sequence_routing
    from pipeline.run_dir import model_dir

    run = tmp_path / "rr"
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "run.name=rr", f"hydra.run.dir={run}", "algo=sync",
           "run.steps=2", "run.eval_every=0", "run.mismatch_every=1", "run.timeout_s=300", "run.progress=false",
           "logger=[]", "orchestrator.groups_per_step=2", "orchestrator.group_size=4",
           "trainer.routing_replay=true", "generator.record_routing=true", "generator.dtype=float32",
           "trainer.export=never"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, f"train failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    steps = list(read_metrics(run, "train_step"))
    assert [s["step"] for s in steps] == [0, 1]
    assert all(np.isfinite(s["loss"]) for s in steps) and any(s["grad_norm"] > 0 for s in steps)
    print("\nper step: routing_differ_frac", [s["routing_differ_frac"] for s in steps],
          "tokens", [s["routing_differ_token_frac"] for s in steps], "mismatch", [s["mismatch"] for s in steps])
    assert all(s["routing_differ_frac"] <= 0.01 for s in steps)
    assert all(s["mismatch"] is not None and s["mismatch"] < 0.02 for s in steps)

    with RolloutLog.open(run) as log:
        batch = log.read(np.arange(log.num_samples))
    layers, k = batch.schema.routed_experts
    sequences, recorded = [], []
    for i in range(len(batch)):
        prompt, completion = batch.prompt(i), batch.tokens("completion_ids", i)
        prompt_routed, completion_routed = batch.prompt(i, "prompt_routed_experts"), batch.tokens("routed_experts", i)
        assert prompt_routed.shape == (len(prompt), layers, k) and prompt_routed.min() >= 0
        assert (completion_routed[-1] == -1).all() and completion_routed[:-1].min(initial=0) >= 0
        if batch.tokens("versions", i).max() == 0:
            sequences.append(np.concatenate([prompt, completion[:-1]]).tolist())
            recorded.append(sequence_routing(prompt_routed, completion_routed))
    assert sequences, "no sample of version 0 in the log"
    compared, ties, differ = compare(model_dir(run), sequences, recorded)
    print(f"recorded routing of {len(sequences)} samples vs transformers: {differ} of {compared} "
          f"(position, layer) pairs differ, {ties} near-ties left out")
    assert differ == 0 and compared > 10 * max(ties, 1)
