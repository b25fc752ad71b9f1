"""kill -9 of every kind of process of a local run, mid-run at seeded steps (seed printed;
TOKENFLOW_CHAOS_SEED replays it): orchestrator, the generator's vLLM engine, then the restarted
generator's role process while its new engine starts (orphaning it), then trainer rank 0. One
generator: training waits while it restarts, so the run cannot finish before the kills (with a
survivor it trains on meanwhile; see pipeline.roles.trainer). The run
recovers by itself from the first three (the orchestrator restarted by the trainer from the log;
the generator restarted twice by its task's supervisor, which ends the orphaned engine, rejoining
the weight group, without a trainer restart), stops within seconds naming
trainer.0 after the fourth with no process left, and the same command completes it. The record
shows no group lost or stored twice and staleness in bound. Real engines, trainer and launcher."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from support.chaos import Chaos, check_record, engine_process, loaded_after_restart, orchestrator_process, role_process, wait_for
from pipeline.metrics import read_metrics
from pipeline.supervise import MARKER_ENV
from support.leftovers import leftovers

pytestmark = pytest.mark.engine
STEPS = 12
GEN = 1  # global rank of the generator (trainer.0, generator.0)


def compose(run_dir: Path, *overrides: str):
    from hydra import compose as hcompose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipeline.config import register, validate
    from pipeline.apps.train import CONFIGS

    register()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        dcfg = hcompose("train", overrides=[f"run.dir={run_dir}", *overrides])
    cfg = OmegaConf.to_object(dcfg)
    validate(cfg)  # as `tokenflow train` does: fills the fields left to the model and task
    return cfg


@pytest.mark.slow  # 258 s in CI: four kills, three engine starts; kill -9 stays in the default suite through
# tests/apps/test_log_netfs_train.py (orchestrator), tests/generator/test_engine_owner_death.py and tests/generator/test_generator.py (mid-broadcast)
def test_kill_9_of_each_process_mid_run_and_the_run_completes(tmp_path):
    import os

    from pipeline.launch import LocalLauncher, TaskFailed
    from pipeline.apps.train import job_plan, prepare_run_dir

    run = tmp_path / "run"
    cfg = compose(run, "run.name=chaos", f"run.steps={STEPS}", "run.eval_every=0", "run.progress=false",
                  "logger=[]", "run.checkpoint_every=2", "cluster.generators=1",
                  "orchestrator.groups_per_step=4", "generator.weight_timeout_s=30",
                  "orchestrator.generator_dead_after_s=5", "run.timeout_s=300")
    prepare_run_dir(cfg)
    chaos = Chaos(run, ["orchestrator", "engine", "generator", "trainer"])
    orch, engine, gen, trainer = chaos.kills
    launched = LocalLauncher().launch(job_plan(cfg, run), run)
    try:
        chaos.running = lambda: launched.state() == "RUNNING"
        trainer_pid = wait_for(lambda: role_process(run, 0), 120, "the trainer role process", chaos.running)
        first_gen = wait_for(lambda: role_process(run, GEN), 120, "the generator", chaos.running)

        chaos.strike(orch, lambda: orchestrator_process(run))
        chaos.strike(engine, lambda: engine_process(run, GEN))
        # the restarted generator is killed again while its new engine starts: the engine is orphaned
        restarted = lambda: role_process(run, GEN) not in (None, first_gen) and role_process(run, GEN)
        orphan = wait_for(lambda: restarted() and engine_process(run, GEN), 600,
                          "the restarted generator's engine", chaos.running)
        chaos.strike(gen, restarted)
        wait_for(lambda: not alive(orphan), 60, f"the orphaned engine {orphan} to be ended")
        wait_for(lambda: loaded_after_restart(run, "generator", 0, 2), 600,
                 "the twice restarted generator to load weights", chaos.running)
        wait_for(lambda: last_after(run, gen.t), 600, "training after the second generator kill", chaos.running)
        assert role_process(run, 0) == trainer_pid, "the trainer restarted"
        assert launched.state() == "RUNNING"
        assert max(r["orchestrator_restarts"] for r in read_metrics(run, "train_step")) == 1
        log = (run / "logs/generator.0.out").read_text()
        assert "restart 1 of 3" in log and "restart 2 of 3" in log, log[-3000:]

        chaos.strike(trainer, lambda: role_process(run, 0))
        with pytest.raises(TaskFailed, match="trainer.0 failed"):
            launched.wait(timeout_s=60)
        stopped_s = time.time() - trainer.t
        assert leftovers(os.environ[MARKER_ENV], wait_s=15, kill=False) == {}, "processes outlived the stopped run"
        launched = LocalLauncher().launch(job_plan(cfg, run), run)  # the same command again
        launched.wait(timeout_s=900)
    finally:
        if not launched.done():  # a failed check: stop the run (its processes would fail the teardown check)
            launched.cancel()

    check_record(run, STEPS, max_staleness=cfg.orchestrator.staleness_limit())
    report = {"seed": chaos.seed, "trainer_stop_s": round(stopped_s, 1),
              "recoveries": [chaos.recovery(k) for k in chaos.kills]}
    print("recovery " + json.dumps(report), flush=True)
    assert all(r["to_training_s"] is not None for r in report["recoveries"])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def last_after(run: Path, t: float) -> bool:
    return any(r["t"] > t for r in read_metrics(run, "train_step"))
