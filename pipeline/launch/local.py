"""LocalLauncher: every task of the plan as a local process (laptop, CI, no Slurm).

Each task is `python -m pipeline.apps.launch_task RUN_DIR LAUNCH_INDEX` with TOKENFLOW_GLOBAL_RANK set,
so it runs exactly the dispatcher the Slurm tasks run (same logs, results, rendezvous). Resource
fields of the plan (nodes, CPUs, memory, partition, ...) are not enforced locally; the task count
(nodes * tasks_per_node per component) is.

Invariant: a run never outlives a failure silently: once any task exits non-zero, `done()` stops
the remaining tasks (SIGTERM to each task's process group, so the processes it started stop too,
then SIGKILL after `kill_grace_s`), so `wait` reports the failure instead of hanging on peers
waiting for the dead task.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

from pipeline.launch.base import Launcher, Run
from pipeline.launch.plan import JobPlan
from pipeline.supervise import end_groups

CANCEL_GRACE_S = 60.0
"""Seconds a cancelled local run's tasks get between SIGTERM and SIGKILL (a step and a checkpoint:
`tokenflow cancel`, a stop signal to `tokenflow train`; `pipeline.doctor.checkpoint_grace` checks a
save fits)."""

class LocalRun(Run):
    def __init__(self, plan: JobPlan, run_dir: Path, launch_index: int, procs: List[subprocess.Popen],
                 kill_grace_s: float) -> None:
        super().__init__(plan, run_dir, launch_index)
        self.procs = procs
        self.pids = [p.pid for p in procs]  # each also leads its process group (recorded for status/cancel)
        self.kill_grace_s = kill_grace_s
        self._cancelled = False

    def state(self) -> str:
        codes = [p.poll() for p in self.procs]
        if self._cancelled:
            return "CANCELLED"
        if any(c not in (None, 0) for c in codes):
            return "FAILED"
        return "COMPLETED" if all(c == 0 for c in codes) else "RUNNING"

    def done(self) -> bool:
        codes = [p.poll() for p in self.procs]
        if any(c not in (None, 0) for c in codes) and any(c is None for c in codes):
            self._stop()
            return True
        return all(c is not None for c in codes)

    def cancel(self, grace_s: float | None = None) -> None:
        """Stop every task: SIGTERM (the trainer checkpoints at its step boundary), SIGKILL to what
        is left after ``grace_s`` (default ``kill_grace_s``); returns once no process of any task's
        process group is left."""
        self._cancelled = True
        self._stop(self.kill_grace_s if grace_s is None else grace_s)

    def _stop(self, grace_s: float | None = None) -> None:
        # each task leads its own process group: signal the group so its children (engines) stop too;
        # exited tasks too: children they left behind are still in the group
        end_groups(self.pids, self.kill_grace_s if grace_s is None else grace_s)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # blocked in the kernel (end_groups named it): not waited for
                pass


class LocalLauncher(Launcher):
    name = "local"

    def __init__(self, kill_grace_s: float = 10.0) -> None:
        self.kill_grace_s = kill_grace_s

    def _start(self, plan: JobPlan, run_dir: Path, launch_index: int) -> LocalRun:
        procs = []
        for global_rank, _ in enumerate(plan.task_layout()):
            env = {**os.environ, **plan.env, "TOKENFLOW_GLOBAL_RANK": str(global_rank)}
            env.pop("SLURM_RESTART_COUNT", None)  # inside a Slurm job, local attempts are not Slurm's
            procs.append(subprocess.Popen(
                [sys.executable, "-u", "-m", "pipeline.apps.launch_task", str(run_dir), str(launch_index)],
                env=env, stdin=subprocess.DEVNULL, start_new_session=True))
        return LocalRun(plan, run_dir, launch_index, procs, self.kill_grace_s)
