"""Launcher and Run: start a JobPlan somewhere, then watch, wait for and cancel it.

A `Launcher` turns a validated `JobPlan` into running tasks (`LocalLauncher`: local processes;
`SlurmLauncher`: one heterogeneous Slurm job) and returns a `Run`. Both write the same run-directory
layout, so everything after the launch reads files, not launcher internals:

    RUN/launch/plan.json        the plan of the latest launch
    RUN/launch/launches.jsonl   one line per launch: launcher, time, Slurm job id or local task pids
                                (its line count = next launch index; read by `tokenflow status`)
    RUN/logs/<role>.<rank>.out  stdout+stderr of every task, appended across attempts
    RUN/results/<role>.<rank>.json  the task's outcome (see pipeline.launch.task)
    RUN/rendezvous/attempt-<n>/     rendezvous files (see pipeline.launch.rendezvous)

Invariants: `Run.wait` never blocks past its timeout; when it returns, every task of the plan
succeeded or, for an optional component, was abandoned after its restarts (result None); otherwise it raises `TaskFailed` naming the first failed
task with the tail of its log, or `TimeoutError` naming the run's state. Nothing of a finished run
is left holding its allocation: once every task has its final result (none of them stopped to be
requeued, all of one attempt) and the run is still not done ``linger_s`` later (an `srun` that never
returned after its tasks exited, a job script stuck after its step), `wait` cancels the run, says so
in a warning, and returns the results.

Example: the last task writes its result at 10:00:00; Slurm still reports RUNNING at 10:01:00
(``linger_s`` 60): the job is cancelled and `wait` returns every task's result.
"""
from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Dict, List

from pipeline.launch.gpus import LAUNCHER_ENV
from pipeline.launch.plan import JobPlan
from pipeline.launch.task import log_path, result_path
from pipeline.run_files import LAUNCHES_FILE, PLAN_FILE

log = logging.getLogger(__name__)
#: How long a run may stay undone after its last task's final result before `Run.wait` cancels it.
LINGER_S = 60.0


class TaskFailed(RuntimeError):
    """A task of the run failed (its entry raised, or it died without a result)."""


def log_tail(run_dir: Path, role: str, rank: int, lines: int = 20) -> str:
    path = log_path(run_dir, role, rank)
    if not path.exists():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Run(ABC):
    """A launched plan."""

    def __init__(self, plan: JobPlan, run_dir: Path, launch_index: int) -> None:
        self.plan = plan
        self.run_dir = Path(run_dir)
        self.launch_index = launch_index
        self.lingered = False
        """`end_lingering` cancelled the run after every task had finished."""
        self._finished_at: float | None = None

    @abstractmethod
    def state(self) -> str:
        """Launcher state of the run, Slurm-style: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ..."""

    @abstractmethod
    def done(self) -> bool:
        """True once no task of the run can still be running."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop every task of the run."""

    def end_lingering(self, linger_s: float = LINGER_S) -> bool:
        """Called while the run is not done: cancel it once its tasks have all finished (see
        `_tasks_finished`) ``linger_s`` ago or more; True if it did (``lingered`` is set)."""
        now = time.monotonic()
        self._finished_at = (self._finished_at or now) if self._tasks_finished() else None
        if self._finished_at is None or now - self._finished_at < linger_s:
            return False
        log.warning("every task of the run in %s has its final result, but the run is still %s %.0f s "
                    "later: cancelling it so that it does not hold its allocation",
                    self.run_dir, self.state(), now - self._finished_at)
        self.cancel()
        self.lingered, self._finished_at = True, None
        return True

    def _tasks_finished(self) -> bool:
        """Every task has a result of one attempt that is final: it succeeded (or was abandoned) and
        did not stop to wait for a requeue (a failed role may still be restarted in place)."""
        try:
            records = [r for rs in self.read_results().values() for r in rs]
        except (OSError, ValueError):  # a result being written
            return False
        return (all(r is not None and (r["ok"] or r.get("abandoned")) and not r.get("stopped") for r in records)
                and len({r.get("attempt") for r in records}) == 1)

    def read_results(self) -> Dict[str, List[Dict[str, Any]]]:
        """role -> the result records present, in rank order from the component's first rank (None
        where a task wrote none)."""
        out: Dict[str, List[Any]] = {}
        for role, rank in self.plan.task_layout():
            path = result_path(self.run_dir, role, rank)
            out.setdefault(role, []).append(json.loads(path.read_text()) if path.exists() else None)
        return out

    def wait(self, timeout_s: float, poll_s: float = 0.5, linger_s: float = LINGER_S) -> Dict[str, List[Any]]:
        """Wait until the run is done; role -> entry return values by rank, or raise naming the
        failure. A run still undone ``linger_s`` after its tasks all finished is cancelled (module
        invariants)."""
        deadline = time.monotonic() + timeout_s
        while not self.done():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run in {self.run_dir} not done after {timeout_s:g} s (state {self.state()})")
            self.end_lingering(linger_s)
            time.sleep(poll_s)
        records = self.read_results()
        by_task = {(role, rank): records[role][rank - self.plan.components[role].first_rank]
                   for role, rank in self.plan.task_layout()}
        failed = [t for t, r in by_task.items() if r and not r["ok"]
                  and not r.get("abandoned")]  # an optional task the run went on without
        failed.sort(key=lambda t: by_task[t].get("stopped_by") is not None)  # stable: layout order within
        missing = [t for t, r in by_task.items() if r is None]
        if failed:  # tasks that failed unasked come first: one stopped by a signal may be their victim
            role, rank = failed[0]
            why = by_task[failed[0]]["error"].strip().splitlines()[-1]
        elif missing:
            role, rank = missing[0]
            why = f"no result (run state {self.state()}; {len(missing)} task(s) without a result)"
        if failed or missing:
            raise TaskFailed(f"task {role}.{rank} failed: {why}\n--- {log_path(self.run_dir, role, rank)}:\n"
                             f"{log_tail(self.run_dir, role, rank)}")
        return {role: [r.get("result") for r in rs] for role, rs in records.items()}


class Launcher(ABC):
    """Starts a JobPlan in a run directory."""

    name = "abstract"

    def launch(self, plan: JobPlan, run_dir: Path | str, plan_file: str = PLAN_FILE,
               launches_file: str = LAUNCHES_FILE, **record: Any) -> Run:
        """Start ``plan``; its JSON goes to ``plan_file`` and one line (plus ``record``) to
        ``launches_file`` (a generator job joining a run keeps its own: `generator_jobs`)."""
        plan.validate()
        plan.env[LAUNCHER_ENV] = self.name  # which rule places each task's GPUs (pipeline.launch.gpus)
        run_dir = Path(run_dir).absolute()
        self.check(plan)
        (run_dir / plan_file).parent.mkdir(parents=True, exist_ok=True)
        launches = run_dir / launches_file
        launch_index = len(launches.read_text().splitlines()) if launches.exists() else 0
        (run_dir / plan_file).write_text(plan.to_json())
        run = self._start(plan, run_dir, launch_index)
        with open(launches, "a") as f:
            f.write(json.dumps({"launcher": self.name, "time": time.time(), "launch_index": launch_index,
                                "job_id": getattr(run, "job_id", None),
                                "pids": getattr(run, "pids", None), **record}) + "\n")
        return run

    def check(self, plan: JobPlan) -> None:
        """Raise LaunchError if this launcher cannot run the plan (before anything starts)."""

    @abstractmethod
    def _start(self, plan: JobPlan, run_dir: Path, launch_index: int) -> Run:
        """Start every task; return without waiting for them."""
