"""Weight-group membership (`docs/architecture.md`, "Weight sync"): a generator dies mid-run, the run goes on with the
survivor; the generator is restarted, rejoins at a new epoch and loads the current weights before
taking work. Real engines, real gloo broadcasts, the real local launcher's task processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.log_format import GroupOutcome
from pipeline.log_reader import RolloutLog
from pipeline.metrics import read_metrics

pytestmark = pytest.mark.engine


def compose(run_dir: Path, *overrides: str):
    from hydra import compose as hcompose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipeline.config import register
    from pipeline.apps.train import CONFIGS

    register()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        dcfg = hcompose("train", overrides=[f"run.dir={run_dir}", *overrides])
    return OmegaConf.to_object(dcfg)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def last_step(run: Path) -> int:
    steps = [r["step"] for r in read_metrics(run, "train_step")]
    return max(steps, default=-1)


def test_a_dead_generator_costs_one_broadcast_and_a_restarted_one_rejoins(tmp_path):
    from pipeline.launch import LocalLauncher
    from pipeline.apps.train import job_plan, prepare_run_dir

    run = tmp_path / "run"
    cfg = compose(run, "run.name=recovery", "run.steps=1000", "run.eval_every=0", "run.progress=false",
                  "run.tensorboard=false", "cluster.generators=2", "orchestrator.groups_per_step=4",
                  "generator.weight_timeout_s=30", "orchestrator.generator_dead_after_s=5",
                  "run.timeout_s=300")
    prepare_run_dir(cfg)
    launched = LocalLauncher().launch(job_plan(cfg, run), run)
    trainer, gen0, gen1 = launched.procs
    try:
        wait_for(lambda: last_step(run) >= 3, 400, "three training steps")
        os.killpg(gen1.pid, signal.SIGKILL)  # generator 1 and its engine processes
        gen1.wait()
        killed_at = last_step(run)
        wait_for(lambda: last_step(run) >= killed_at + 4, 300, "training to go on with the survivor")
        steps = list(read_metrics(run, "train_step"))
        assert steps[-1]["sync_failures"] >= 1, "the dead generator's broadcast did not fail?"
        # Restart generator 1 exactly as the launcher started it.
        env = {**os.environ, "TOKENFLOW_GLOBAL_RANK": "2"}
        restarted = subprocess.Popen([sys.executable, "-u", "-m", "pipeline.launch.task", str(run), "0"],
                                     env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        rejoined_at = wait_for(lambda: _rejoined_version(run), 400, "the restarted generator to load weights")
        wait_for(lambda: _samples_after(run, rejoined_at["t"]), 300, "samples from the restarted generator")
        assert trainer.poll() is None, "the trainer stopped: " + (run / "logs" / "trainer.0.out").read_text()[-3000:]
    finally:
        for p in [trainer, gen0, gen1] + ([restarted] if "restarted" in locals() else []):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in [trainer, gen0, gen1] + ([restarted] if "restarted" in locals() else []):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    with RolloutLog.open(run) as log:
        g = log.groups()
        stored = g["group_id"][g["outcome"] == GroupOutcome.STORED]
        assert len(stored) == len(np.unique(stored)), "a group was stored twice"
        gen_ids = log.column("samples/generator_id")
        t_start = log.column("samples/t_start")
        versions = log.min_versions()
    late = gen_ids == 1
    restart_t = rejoined_at["t"]
    after = late & (t_start > restart_t)
    assert after.any(), "the restarted generator never contributed samples"
    # It took work only after loading the current weights.
    assert versions[after].min() >= rejoined_at["version"]


def _samples_after(run: Path, t: float) -> bool:
    with RolloutLog.open(run) as log:
        gen, start = log.column("samples/generator_id"), log.column("samples/t_start")
    return bool(((gen == 1) & (start > t)).any())


def _rejoined_version(run: Path) -> dict | None:
    """Time and version of the first weights the restarted generator 1 loaded."""
    log = (run / "logs" / "generator.1.out").read_text()
    attempts = log.split("joined weight group epoch")
    if len(attempts) < 3:  # first start, then the restart
        return None
    for line in attempts[-1].splitlines():
        if "loaded version" in line:
            stamp = " ".join(line.split()[:2])
            t = time.mktime(time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S"))
            return {"t": t, "version": int(line.split("loaded version")[1].split()[0])}
    return None
