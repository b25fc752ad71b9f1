"""Generator jobs: extra generators that join a running run from their own job, and leave it.

`tokenflow generators RUN --count N [cluster=slurm] [cluster.generator.*=...]` starts N generators
for the run going on in RUN: local processes (detached, each under the same task supervisor as the
run's own tasks) or one Slurm job (not heterogeneous: one component, generator). Their tasks find
the run through its directory: the plan of their job (`GENERATOR_JOB_PLAN`, named by `PLAN_ENV`), the
run's current attempt (`rendezvous.running_attempt`: where the trainer published its address), the
orchestrator's address and the run's secret; from there on they are ordinary generators (see
`pipeline.roles.generator`): Hello, join the next weight group the trainer builds (it rebuilds
when the orchestrator's members change), load the current weights, only then take leases.
Leaving is a generator's stop signal (SIGTERM: scancel, `kill -TERM -PID`; the checkpoint signal
Slurm sends before the job's time limit): see `docs/generator-jobs.md`. A generator job at its time
limit (or preempted) departs for good: it is not requeued unless started with ``requeue=True``
(``tokenflow generators --requeue``; then up to ``cluster.max_requeues`` times, rejoining the run).

Invariants:
- generator ranks (hence identities ``gen-<rank>``, logs ``generator.<rank>.out``, results) are
  unique across the run and all its generator jobs: a job gets the block ``[first, first + N)``
  with ``first`` = max(cluster.generators, end of every earlier job's block), allocated under an
  exclusive lock of ``generator-jobs.lock`` held until the job's line is in `GENERATOR_JOBS_FILE`;
  a rank is never given twice, also not after its job ended;
- a job's tasks take the run's attempt at their start, so they read the rendezvous of the trainer
  that is running; they stop when that trainer's attempt ends (its result), when the orchestrator
  says ``stop`` or, if the run's own tasks are all gone (local pids, Slurm job), within
  `RUN_CHECK_S` seconds.

Worked example: a run with cluster.generators=1 (generator 0). ``--count 2`` -> job 0, ranks 1, 2
(plan ``launch/generators-0.json``, ``first_rank=1``); a later ``--count 1`` -> job 1, rank 3, even
if job 0 has ended by then.
"""
from __future__ import annotations

import fcntl
import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.launch.task import JOINS_RUN, PLAN_ENV, REQUEUES
from pipeline.run_files import GENERATOR_JOB_PLAN, GENERATOR_JOBS_FILE, LAUNCHES_FILE

RUN_CHECK_S = 30.0
"""How often a joined generator checks that the run's own tasks still exist."""
JOB_ENV = "TOKENFLOW_GENERATOR_JOB"
"""Set in a generator job's tasks to its name (``genjob-<index>``; the run's own: unset)."""


def job_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every generator job started for the run, oldest first (one `GENERATOR_JOBS_FILE` line each)."""
    path = Path(run_dir) / GENERATOR_JOBS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def next_first_rank(run_generators: int, records: list[dict[str, Any]]) -> int:
    """The first generator rank free for a new job: after the run's own and every job's block."""
    return max([run_generators, *(r["first_rank"] + r["count"] for r in records)])


def job_plan(cfg, run_dir: Path, count: int, first_rank: int, index: int, run_launch: dict[str, Any],
             requeue: bool = False):
    """The plan of generator job ``index``: one component, generator, ranks first_rank.. ; requeued
    at its time limit only with ``requeue``."""
    from pipeline.launch.network import network_env
    from pipeline.launch.plan import JobPlan

    c = cfg.cluster
    spec = replace(c.generator, first_rank=first_rank)
    if c.launcher == "local":
        spec = replace(spec, nodes=1, tasks_per_node=count)
    elif count % spec.tasks_per_node:
        raise ValueError(f"--count {count} is not a multiple of cluster.generator.tasks_per_node "
                         f"({spec.tasks_per_node})")
    else:
        spec = replace(spec, nodes=count // spec.tasks_per_node)
    name = f"genjob-{index}"
    return JobPlan(name=f"tokenflow-{cfg.run.name}-{name}", components={"generator": spec},
                   env={**network_env(c.network), PLAN_ENV: GENERATOR_JOB_PLAN.format(index=index), JOB_ENV: name},
                   config={"run_dir": str(run_dir), JOINS_RUN: True, "timeout_s": cfg.run.timeout_s,
                           "run_launcher": run_launch.get("launcher"), "run_job_id": run_launch.get("job_id"),
                           "run_pids": run_launch.get("pids"), REQUEUES: requeue},
                   max_requeues=c.max_requeues if requeue else 0)


def start_job(cfg, run_dir: Path, count: int, requeue: bool = False) -> dict[str, Any]:
    """Allocate ranks, start the job (requeued at its time limit only with ``requeue``), record it;
    returns its record (a `GENERATOR_JOBS_FILE` line)."""
    from pipeline.launch import LocalLauncher, SlurmLauncher

    run_dir = Path(run_dir).resolve()
    if count < 1:
        raise ValueError(f"--count must be >= 1, got {count}")
    launches = run_dir / LAUNCHES_FILE
    if not launches.exists():
        raise FileNotFoundError(f"{launches} is missing: {run_dir} was never launched")
    run_launch = json.loads(launches.read_text().splitlines()[-1])
    lock_path = run_dir / GENERATOR_JOBS_FILE.replace(".jsonl", ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until this job's line is written: no rank twice
        records = job_records(run_dir)
        index, first = len(records), next_first_rank(cfg.cluster.generators, records)
        plan = job_plan(cfg, run_dir, count, first, index, run_launch, requeue)
        launcher = LocalLauncher() if cfg.cluster.launcher == "local" else SlurmLauncher()
        run = launcher.launch(plan, run_dir, plan_file=GENERATOR_JOB_PLAN.format(index=index),
                              launches_file=GENERATOR_JOBS_FILE, job=plan.env[JOB_ENV], first_rank=first,
                              count=count)
        if hasattr(run, "procs"):  # detached: this command returns, the tasks go on
            for p in run.procs:
                p.returncode = 0  # not ours to reap (Popen's destructor would warn)
    return job_records(run_dir)[index]


def run_alive(config: dict[str, Any]) -> bool:
    """Whether any task of the run a generator job joined still exists (its local task pids, or
    its Slurm job); True when that cannot be told."""
    if config.get("run_launcher") == "local":
        return any(_pid_alive(p) for p in config.get("run_pids") or [])
    job = config.get("run_job_id")
    if not job:
        return True
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return out.returncode != 0 or bool(out.stdout.strip())  # squeue fails for jobs it forgot: say alive


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def jobs_status(run_dir: Path) -> list[dict[str, Any]]:
    """Every generator job of the run (the run's own first) with its state and generators: rank,
    version loaded, tokens/s, weight group, whether it left, from the newest metrics records."""
    from pipeline.metrics import read_metrics

    run_dir = Path(run_dir)
    latest: dict[int, dict[str, Any]] = {}
    events: dict[int, str] = {}
    for rec in read_metrics(run_dir):
        if rec.get("kind") == "generator":
            latest[rec["generator_id"]] = rec
        elif rec.get("kind") == "membership" and rec.get("generator_id") is not None:
            events[rec["generator_id"]] = rec["event"]
    launches = run_dir / LAUNCHES_FILE
    run_launch = json.loads(launches.read_text().splitlines()[-1]) if launches.exists() else {}
    from omegaconf import OmegaConf
    run_gens = int(OmegaConf.load(run_dir / "config.yaml").cluster.generators)
    jobs = [{"job": "run", "launcher": run_launch.get("launcher"), "job_id": run_launch.get("job_id"),
             "pids": None, "first_rank": 0, "count": run_gens}, *job_records(run_dir)]
    out = []
    for job in jobs:
        if job["job"] != "run" and job.get("job_id"):
            state = _slurm_state(str(job["job_id"]))
        elif job["job"] != "run":
            state = "RUNNING" if any(_pid_alive(p) for p in job.get("pids") or []) else "EXITED"
        else:
            state = "-"  # the run's own component: its state is the run's (`tokenflow status` above)
        gens = []
        for rank in range(job["first_rank"], job["first_rank"] + job["count"]):
            rec = latest.get(rank, {})
            gens.append({"rank": rank, "version": rec.get("version"), "tokens_per_s": rec.get("tokens_per_s"),
                         "weight_epoch": rec.get("weight_epoch"), "last_event": events.get(rank)})
        out.append({**{k: job.get(k) for k in ("job", "launcher", "job_id", "pids")}, "state": state,
                    "generators": gens})
    return out


def _slurm_state(job_id: str) -> str:
    from pipeline.launch.slurm import slurm_states

    states = slurm_states(job_id)
    return states[0]["state"] if 0 in states else "UNKNOWN"


def format_jobs(jobs: list[dict[str, Any]]) -> list[str]:
    """Lines of `tokenflow status`: one per generator job, one per generator under it."""
    lines = []
    for job in jobs:
        where = f"slurm job {job['job_id']}" if job.get("job_id") else (
            f"pids {job['pids']}" if job.get("pids") else "the run's job")
        lines.append(f"gen job    {job['job']:<9} {job['state']:<10} {where}")
        for g in job["generators"]:
            tps = f"{g['tokens_per_s']:.0f} tokens/s" if g["tokens_per_s"] is not None else "no report yet"
            lines.append(f"             generator {g['rank']:<3} version {g['version']}  {tps}  "
                         f"weight group {g['weight_epoch']}  last event {g['last_event'] or '-'}")
    return lines
