"""The two steps around `srun` in slurm/train.sbatch (a heterogeneous job submitted by hand).

    python -m pipeline.apps.batch prepare [--run-dir RUN | OVERRIDES...]   -> prints "RUN_DIR LAUNCH_INDEX STOP_GRACE_S"
    srun --het-group=0,1 python -m pipeline.apps.launch_task RUN_DIR LAUNCH_INDEX        (the same dispatcher as submitit's)
    python -m pipeline.apps.batch finish RUN_DIR                            -> requeue, done, or failed

`prepare` composes the config exactly as ``tokenflow train`` does (same Hydra overrides; the run
directory is ``hydra.run.dir``, i.e. runs/<run.name>), validates it, writes RUN/config.yaml and
the job plan RUN/launch/plan.json, and records the launch (launcher "sbatch", this job's id) so
that ``tokenflow status`` and ``tokenflow cancel`` work. With ``--run-dir`` it reuses the plan a run
directory already has. On a requeued start of the same job it reuses that job's launch index, so
attempts stay `launch index + SLURM_RESTART_COUNT` and strictly increase.

Each task checks that Slurm's components match the plan (`pipeline.launch.task.locate`): an
sbatch header whose components differ from cluster.trainer / cluster.generator fails at once,
naming the component.

`finish` reads RUN/results/: a trainer that stopped on the checkpoint signal (``--signal=USR2@90``)
gets the job requeued (`scontrol requeue`); a completed run gets its plot and COMPLETE marker
(as ``tokenflow train`` does); anything else exits 1 naming the failed task.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List

from pipeline.launch.base import log_tail
from pipeline.launch.plan import JobPlan
from pipeline.launch.task import result_path
from pipeline.run_files import CONFIG_FILE, LAUNCHES_FILE, PLAN_FILE


def _record_launch(run_dir: Path, job_id: str) -> int:
    launches = run_dir / LAUNCHES_FILE
    lines = [json.loads(line) for line in launches.read_text().splitlines()] if launches.exists() else []
    if lines and str(lines[-1].get("job_id")) == job_id:
        return int(lines[-1]["launch_index"])  # a requeued start of the same job
    launches.parent.mkdir(parents=True, exist_ok=True)
    with open(launches, "a") as f:
        f.write(json.dumps({"launcher": "sbatch", "time": time.time(), "launch_index": len(lines),
                            "job_id": job_id, "pids": None}) + "\n")
    return len(lines)


def prepare(argv: List[str]) -> tuple[Path, JobPlan]:
    """The run directory and its validated job plan (written there unless ``--run-dir`` reuses it)."""
    if argv[:1] == ["--run-dir"]:
        run_dir = Path(argv[1]).resolve()
        plan = JobPlan.from_json((run_dir / PLAN_FILE).read_text())
        plan.validate()
        return run_dir, plan
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from pipeline.config import register, validate
    from pipeline.apps.train import CONFIGS, job_plan, prepare_run_dir

    register()
    with initialize_config_dir(str(CONFIGS), version_base=None):
        dcfg = compose("train", overrides=argv, return_hydra_config=True)
    run_dir = str(dcfg.hydra.run.dir)  # runs/${run.name} unless overridden, as for tokenflow train
    with open_dict(dcfg):
        del dcfg["hydra"]
    dcfg.run.dir = run_dir
    cfg = OmegaConf.to_object(dcfg)
    if cfg.cluster.launcher != "slurm":
        raise SystemExit("slurm/train.sbatch runs cluster=slurm configs (add cluster=slurm)")
    validate(cfg)
    run_dir = prepare_run_dir(cfg)
    plan = job_plan(cfg, run_dir)
    plan.validate()
    (run_dir / PLAN_FILE).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / PLAN_FILE).write_text(plan.to_json())
    return run_dir, plan


def finish(run_dir: Path) -> int:
    plan = JobPlan.from_json((run_dir / PLAN_FILE).read_text())
    records = {}
    for role, rank in plan.task_layout():
        path = result_path(run_dir, role, rank)
        records[(role, rank)] = json.loads(path.read_text()) if path.exists() else None
    first = records[plan.task_layout()[0]]
    if first and first["ok"] and first.get("stopped"):
        job_id = os.environ["SLURM_JOB_ID"]
        print(f"tokenflow: stopped on the checkpoint signal; requeueing job {job_id}", flush=True)
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
        return 0
    bad = [(task, r) for task, r in records.items() if not r or not r["ok"]]
    if bad:
        (role, rank), record = bad[0]
        why = record["error"].strip().splitlines()[-1] if record else "no result"
        print(f"tokenflow: task {role}.{rank} failed: {why}\n{log_tail(run_dir, role, rank)}", file=sys.stderr)
        return 1
    if (run_dir / CONFIG_FILE).exists() and "trainer" in plan.components:
        from omegaconf import OmegaConf

        from pipeline.observe.plots import plot_run
        from pipeline.apps.train import COMPLETE
        print(f"tokenflow: done; learning curve in {plot_run(run_dir)}")
        steps = OmegaConf.load(run_dir / CONFIG_FILE).run.steps  # the marker `tokenflow train` writes
        (run_dir / COMPLETE).write_text(f"{steps} steps, finished {time.strftime('%Y-%m-%d %H:%M:%S')}")
    return 0


def main(argv: List[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prepare"]:
        run_dir, plan = prepare(argv[1:])
        print(run_dir, _record_launch(run_dir, os.environ.get("SLURM_JOB_ID", "none")),
              math.ceil(plan.stop_grace_s))  # whole seconds, for the script's countdown
        return 0
    if argv[:1] == ["finish"] and len(argv) == 2:
        return finish(Path(argv[1]).resolve())
    print("usage: python -m pipeline.apps.batch prepare [--run-dir RUN | OVERRIDES...] | finish RUN_DIR",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
