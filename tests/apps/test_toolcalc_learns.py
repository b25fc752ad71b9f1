"""The tool task learns, through a kill -9 of the orchestrator (slow: TOKENFLOW_SLOW=1 or `-m slow`).

One local run of `task=toolcalc` (multi-turn calculator episodes, tiny MoE model warm-started on the
tool format): held-out greedy accuracy must rise by at least 30 points within 12 minutes of
training (warm-start excluded: it is cached per model and task). The orchestrator is killed with
SIGKILL after a seeded early step (TOKENFLOW_CHAOS_SEED); the trainer restarts it from the log and
the record must still hold every episode exactly once (`chaos.check_record`). Then `tokenflow
inspect` shows the episodes' tool calls and `tokenflow replay` trains from the episode log.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from support.chaos import Chaos, check_record, orchestrator_process
from pipeline.metrics import read_metrics
from test_weight_recovery import compose

pytestmark = [pytest.mark.engine, pytest.mark.slow]

STEPS = 40
BUDGET_S = 12 * 60


def test_toolcalc_learns_by_30_points_through_an_orchestrator_kill(tmp_path):
    from pipeline.apps.train import job_plan, prepare_run_dir
    from pipeline.launch import LocalLauncher

    run = tmp_path / "tool"
    cfg = compose(run, "run.name=tool", "task=toolcalc", f"run.steps={STEPS}", "run.eval_every=10",
                  "run.progress=false", "logger=[]", "run.checkpoint_every=10",
                  "orchestrator.groups_per_step=8", "orchestrator.group_size=8", "run.timeout_s=300")
    prepare_run_dir(cfg)
    chaos = Chaos(run, ["orchestrator"], first=3, spread=4)
    t0 = time.time()
    launched = LocalLauncher().launch(job_plan(cfg, run), run)
    try:
        chaos.running = lambda: launched.state() == "RUNNING"
        chaos.strike(chaos.kills[0], lambda: orchestrator_process(run), timeout=BUDGET_S)
        launched.wait(timeout_s=BUDGET_S + 300)
    finally:
        if not launched.done():
            launched.cancel()
    wall = time.time() - t0
    check_record(run, STEPS, max_staleness=cfg.orchestrator.staleness_limit())
    assert max(r["orchestrator_restarts"] for r in read_metrics(run, "train_step")) == 1
    steps = list(read_metrics(run, "train_step"))
    start = min(r["t"] for r in steps) - steps[0]["step_s"] - steps[0]["wait_s"]  # RL began (after warm-start)
    evals = {e["step"]: e["accuracy"] for e in read_metrics(run, "eval")}
    print("toolcalc " + json.dumps({"evals": evals, "rl_s": round(max(r["t"] for r in steps) - start, 1),
                                    "wall_s": round(wall, 1), "chaos_seed": chaos.seed,
                                    "recovery": chaos.recovery(chaos.kills[0])}), flush=True)
    assert max(evals[k] for k in evals if k > 0) - evals[0] >= 0.30, evals
    assert max(r["t"] for r in steps) - start <= BUDGET_S

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "inspect", str(run), "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    episodes = json.loads(out.stdout)["episodes"]
    print("inspect episodes " + json.dumps({k: v for k, v in episodes.items() if k != "examples"}))
    assert episodes["tool_calls"] > 0 and episodes["env_tokens_masked"] > 0
    assert any(t["role"] == "env" and "tool" in t["text"] for ex in episodes["examples"] for t in ex["turns"])
    rep = subprocess.run([sys.executable, "-m", "pipeline.cli", "replay", str(run), "run.steps=2",
                          f"hydra.run.dir={tmp_path / 'replay'}", "run.progress=false", "logger=[]",
                          "orchestrator.groups_per_step=4", "run.eval_every=0"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert rep.returncode == 0, rep.stderr[-4000:]
    replayed = list(read_metrics(tmp_path / "replay", "train_step"))
    assert [r["step"] for r in replayed] == [0, 1] and all(r["tokens"] > 0 for r in replayed)
