"""Runs and jobs on the Slurm test cluster (slurm/cluster/start.sh) as the Slurm tests drive them.

`TINY`: the overrides of a tiny run (1 trainer task + 1 vLLM generator task, one heterogeneous job
over two fake nodes); `tokenflow` runs the CLI; `status_of`, `submitted_job` and `wait_until`
follow a run; `submit_probe_batch` submits a two-role probe plan through slurm/train.sbatch;
`preempt_trainer_node` preempts a run with an exclusive job of partition `urgent`; `ended` is the
teardown every test that starts a run in the background needs (the run, its job and the urgent
job end however the test ends).

Example: ``with ended(proc, run) as urgent: ...; urgent.append(preempt_trainer_node(run))``.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from pipeline.launch import ComponentSpec, JobPlan
from support.child_env import child_env

REPO = Path(__file__).resolve().parents[2]
TINY = ["cluster=slurm", "run.eval_every=3", "run.timeout_s=300", "run.progress=false", "logger=[]",
        "orchestrator.groups_per_step=4", "orchestrator.group_size=8", "model.warmstart_steps=120",
        "cluster.generators=1", "cluster.generator.nodes=1", "cluster.trainer.mem_gb=3", "cluster.generator.mem_gb=3.5",
        "cluster.trainer.cpus_per_task=2", "cluster.generator.cpus_per_task=2", "cluster.trainer.time_min=30",
        "cluster.generator.time_min=30"]


def tokenflow(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, env=child_env(),
                          timeout=timeout, cwd=REPO)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not true after {timeout_s} s")
        time.sleep(poll_s)


def submitted_job(run: Path) -> str | None:
    """The Slurm job id of the run's last launch, once its line is written (the file may exist empty)."""
    try:
        lines = (run / "launch/launches.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["job_id"] if lines else None
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def status_of(run: Path) -> dict:
    out = tokenflow("status", str(run), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def submit_probe_batch(run: Path, name: str, hold_s: float, **env: str) -> str:
    """Submit slurm/train.sbatch for a plan of two probe roles (trainer, generator) that publish in
    the rendezvous and hold on attempt 0 for up to ``hold_s`` until stopped; its batch log is
    run/batch.out. Returns the job id."""
    plan = JobPlan(name=name, components={
        "trainer": ComponentSpec(entry="pipeline.launch.probe:probe", mem_gb=0.5, time_min=5),
        "generator": ComponentSpec(entry="pipeline.launch.probe:probe", mem_gb=0.5, time_min=5)},
        config={"probe": {"timeout_s": 60, "rendezvous": True, "hold_s": hold_s}})
    (run / "launch").mkdir()
    (run / "launch/plan.json").write_text(plan.to_json())
    return subprocess.run(["sbatch", "--parsable", f"--output={run}/batch.out", "slurm/train.sbatch", "--run-dir",
                           str(run)], capture_output=True, text=True, timeout=30, cwd=REPO,
                          env=dict(os.environ, **env), check=True).stdout.strip()


def preempt_trainer_node(run: Path) -> str:
    """Submit a 5 s exclusive job of partition `urgent` on the node of ``run``'s trainer (its
    partition `preemptible` is preempted by it); returns that job's id."""
    node = status_of(run)["components"][0]["nodes"]
    return subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-w", node, "--exclusive", "-t", "2",
                           "-o", "/dev/null", "--wrap", "sleep 5"], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


@contextlib.contextmanager
def ended(proc: subprocess.Popen, run: Path) -> Iterator[list[str]]:
    """Yields a list for the ids of jobs the test submits beside the run (`preempt_trainer_node`);
    on leaving, a `tokenflow train` still running is killed and its run cancelled, and each of those
    jobs is cancelled."""
    jobs: list[str] = []
    try:
        yield jobs
    finally:
        if proc.poll() is None:
            proc.kill()
            tokenflow("cancel", str(run))
        for job in jobs:
            subprocess.run(["scancel", job], timeout=30)
