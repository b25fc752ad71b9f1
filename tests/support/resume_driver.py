"""Kill the trainer of a local `tokenflow train` run with SIGKILL after a checkpoint, resume it
with the same command, and count what the run wasted (used by `test_resume_waste.py`, and runnable
on its own to measure a checkout: ``PYTHONPATH=CHECKOUT python tests/support/resume_driver.py RUN_ROOT``).

Counted from the run's rollout log and metrics (independent of the orchestrator's own counters):
groups wasted as stale (``EVICTED_STALE`` rows: stored, then evicted; ``DROPPED_STALE`` rows:
generated, too stale when scored), groups dropped by the rollback (``DROPPED_ROLLBACK`` rows, where
the code has that outcome), the stored and the resolved groups, and the lowest ``kept`` any
orchestrator metric line reported.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ARGS = ["run.checkpoint_every=4", "run.eval_every=0", "run.mismatch_every=0", "run.timeout_s=400",
        "run.progress=false", "logger=[]", "orchestrator.groups_per_step=4",
        "orchestrator.group_size=8"]


def _command(run_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "train", f"run.name={run_dir.name}",
            f"hydra.run.dir={run_dir}", f"run.steps={steps}", *ARGS]


def _last_step(run_dir: Path) -> int:
    from pipeline.metrics import read_metrics

    return max((int(rec["step"]) for rec in read_metrics(run_dir, "train_step")), default=-1)


def _trainer_pid(run_dir: Path) -> int:
    """The role process of trainer rank 0 (global rank 0; not its task supervisor, whose death would
    be a clean stop of the role). The orchestrator dies with it."""
    from support.chaos import role_process

    pid = role_process(run_dir, 0)
    if pid is None:
        raise RuntimeError(f"no trainer role process of {run_dir} found")
    return pid


def run_killed_and_resumed(run_dir: Path, steps: int, kill_after: int, timeout_s: float = 900) -> float:
    """Start the run, SIGKILL its trainer once step ``kill_after`` is logged, resume to the end.
    Returns the time (``t`` of the metrics records) when the killed run had ended: the resumed run's
    records come after it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(run_dir.with_suffix(".driver.log"), "a")
    proc = subprocess.Popen(_command(run_dir, steps), stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while _last_step(run_dir) < kill_after:
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended (rc {proc.returncode}) before step {kill_after}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {kill_after} not reached in {timeout_s}s")
            time.sleep(0.5)
        os.kill(_trainer_pid(run_dir), signal.SIGKILL)
        proc.wait(timeout=120)  # the launcher stops the other tasks and reports the failure
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    killed_at = time.time()
    out = subprocess.run(_command(run_dir, steps), stdout=log, stderr=subprocess.STDOUT, env=env,
                         timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"the resumed run failed (rc {out.returncode}); see {log.name}")
    return killed_at


def waste(run_dir: Path) -> dict:
    import numpy as np

    from pipeline.rollout_log.format import GroupOutcome
    from pipeline.rollout_log.reader import RolloutLog

    with RolloutLog.open(run_dir) as log:
        g = log.groups()
        outcome = g["outcome"]
        rollback = getattr(GroupOutcome, "DROPPED_ROLLBACK", None)
        stored = g["group_id"][outcome == GroupOutcome.STORED]
        result = {"stored": int(len(stored)), "stored_twice": int(len(stored) - len(np.unique(stored))),
                  "evicted_stale": int((outcome == GroupOutcome.EVICTED_STALE).sum()),
                  "dropped_stale": int((outcome == GroupOutcome.DROPPED_STALE).sum()),
                  "resolved": int(len(np.unique(g["group_id"]))),
                  "dropped_rollback": int((outcome == rollback).sum()) if rollback is not None else None,
                  "steps": sorted(log.resume_state().step_rows)}
    from pipeline.metrics import read_metrics

    kept = [rec.get("kept") for rec in read_metrics(run_dir, "orchestrator")]
    result["min_kept"] = min(k for k in kept if k is not None)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args()
    seed = a.seed if a.seed is not None else random.randrange(1 << 16)
    kill_after = random.Random(seed).randrange(5, a.steps - 8)
    print(f"seed {seed}: SIGKILL the trainer after step {kill_after}", flush=True)
    a.root.mkdir(parents=True, exist_ok=True)
    run_dir = a.root / f"resume-{seed}"
    run_killed_and_resumed(run_dir, a.steps, kill_after)
    print(json.dumps({"seed": seed, "kill_after": kill_after, **waste(run_dir)}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the tests' root (support.chaos)
    main()
