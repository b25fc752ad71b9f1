"""Lagged self-distillation in a whole `tokenflow train` run: trainer (megatron-core), a vLLM
generator and a vLLM teacher K versions behind the policy, refreshed from the versions it receives
over the weight channel (a member of the trainer's weight group), with GRPO plus the reverse-KL term. A long run on 2 cores: marked slow (TOKENFLOW_SLOW=1 runs it)."""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from pipeline.rollout_log.format import GroupOutcome
from pipeline.rollout_log.reader import RolloutLog
from pipeline.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.engine]
LAG, EVERY, STEPS = 2, 3, 12


def test_lagged_self_distillation_run_keeps_the_teacher_in_its_window(tmp_path, request):
    run = tmp_path / "sd"
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "run.name=sd", f"hydra.run.dir={run}",
           f"run.steps={STEPS}", f"run.checkpoint_every={EVERY}", "run.eval_every=0", "run.progress=false",
           "logger=[]", "run.timeout_s=300", "orchestrator.groups_per_step=4",
           "orchestrator.group_size=8", "scorers.teacher=lagged", f"scorers.teacher_lag={LAG}",
           "trainer.loss.distill_coef=0.5"]
    temp = Path(tempfile.mkdtemp(prefix="tf-sd-"))  # the run's temp directory (short: socket paths live
    request.addfinalizer(lambda: shutil.rmtree(temp, ignore_errors=True))  # in it); its engines' must go
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(temp)})
    assert out.returncode == 0, f"train failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    left = sorted(p.name for p in temp.iterdir() if p.name.startswith("tf-engine-"))
    assert not left, f"engine socket directories left by the generator and the teacher: {left}"
    steps = [m for m in read_metrics(run, "train_step")]
    assert len(steps) == STEPS and all(math.isfinite(m["teacher_kl"]) for m in steps)
    print("teacher_kl per step:", " ".join(f"{m['teacher_kl']:.3f}" for m in steps))
    with RolloutLog.open(run / "rollouts") as log:
        g = log.groups()
        stored = g["group_id"][g["outcome"] == GroupOutcome.STORED]
        assert len(stored) == len(np.unique(stored))
        batch = log.read(log.rows())
        consumed_at = {int(r): tv for _, tv, rows in log.step_records() for r in rows}
        rows = log.rows()
    teacher = [m for m in read_metrics(run, "scorer") if m.get("service") == "teacher"][-1]
    print("teacher:", {k: v for k, v in teacher.items() if k.startswith(("refresh_", "weights_", "snapshots_"))})
    assert teacher["weights_received"] >= STEPS - LAG and teacher["weight_failures"] == 0
    assert teacher["refresh_channel"] >= 2 and teacher["refresh_checkpoint"] == 0  # every refresh over the channel
    assert teacher["snapshots_held"] <= LAG // EVERY + 2
    tv = batch.columns["teacher_version"]
    print("samples by teacher version:", dict(zip(*np.unique(tv, return_counts=True))))
    assert len(set(tv.tolist())) >= 2 and all(t % EVERY == 0 for t in tv.tolist())  # refreshed
    for i in range(len(batch)):
        t, newest = int(tv[i]), int(batch.tokens("versions", i).max())
        assert t >= newest - LAG - EVERY + 1, (i, t, newest)
        if int(rows[i]) in consumed_at and t:
            assert t <= consumed_at[int(rows[i])] - LAG, (i, t, consumed_at[int(rows[i])])
