"""A lagged teacher as a component of the Slurm heterogeneous job (real test cluster,
slurm/cluster/start.sh): trainer, generator and teacher each on their own fake node; the teacher
receives the policy over the weight channel across components and refreshes from it."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.rollout_log.reader import RolloutLog
from pipeline.metrics import read_metrics
from support.slurm_runs import TINY, tokenflow

pytestmark = [pytest.mark.slurm, pytest.mark.engine]
LAG, EVERY, STEPS = 1, 2, 6


@pytest.mark.slow  # a whole Slurm run with three engines' worth of start-up: TOKENFLOW_SLOW=1 runs it
def test_lagged_teacher_component_on_slurm_refreshes_over_the_weight_channel(tmp_path):
    run = tmp_path / "sdt"
    out = tokenflow("train", "run.name=sdt", f"hydra.run.dir={run}", f"run.steps={STEPS}",
                    f"run.checkpoint_every={EVERY}", *TINY, "run.eval_every=0", "scorers.teacher=lagged",
                    f"scorers.teacher_lag={LAG}", "trainer.loss.distill_coef=0.5", "cluster.teacher.mem_gb=3",
                    "cluster.teacher.cpus_per_task=2", "cluster.teacher.time_min=30", timeout=1500)
    assert out.returncode == 0, f"train failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    steps = list(read_metrics(run, "train_step"))
    assert len(steps) == STEPS and all(math.isfinite(m["teacher_kl"]) for m in steps)
    teacher = [m for m in read_metrics(run, "scorer") if m.get("service") == "teacher"][-1]
    print("teacher:", {k: v for k, v in teacher.items() if k.startswith(("refresh_", "weights_", "snapshots_"))})
    assert teacher["refresh_channel"] >= 1 and teacher["weights_received"] >= STEPS - LAG - EVERY
    with RolloutLog.open(run / "rollouts") as log:
        batch = log.read(log.rows())
    tv = batch.columns["teacher_version"]
    print("samples by teacher version:", dict(zip(*np.unique(tv, return_counts=True))))
    for i in range(len(batch)):
        assert int(tv[i]) >= int(batch.tokens("versions", i).max()) - LAG - EVERY + 1
