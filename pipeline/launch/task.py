"""What runs inside every task: find my role, set up logs, call the role's entry function.

The same dispatcher serves both launchers:
- on Slurm, `RoleDispatcher` is the callable submitit runs in each task of the heterogeneous job;
  the task's global rank is `SLURM_PROCID`, numbered component after component, so with the plan's
  layout [(trainer,0), (trainer,1), (generator,0)] SLURM_PROCID=2 is generator rank 0. The
  component sizes Slurm reports (`SLURM_HET_SIZE`, `SLURM_NTASKS_HET_GROUP_k`) must match the plan,
  otherwise the task refuses to start and says which component differs;
- locally and in slurm/train.sbatch, `python -m pipeline.apps.launch_task RUN_DIR LAUNCH_INDEX` reads
  `RUN/launch/plan.json` (the global rank: TOKENFLOW_GLOBAL_RANK, else SLURM_PROCID).

Invariants:
- each task's stdout and stderr (file descriptors 1 and 2, so child processes too) go to
  `RUN/logs/<role>.<rank>.out`, appended, one header line per attempt;
- each task writes `RUN/results/<role>.<rank>.json` ({"ok", "attempt", "result" | "error"})
  when its entry returns or raises; a stale file from an earlier attempt is removed at start;
- `attempt` counts the starts of this run: launches before this one in the same run directory plus
  Slurm requeues of this job (`SLURM_RESTART_COUNT`); `resumed` is `attempt > 0`;
- the checkpoint signal (USR2: Slurm sends it `signal_delay_s` before the time limit, and
  `SlurmRun.preempt()` sends it) sets `task.stop_requested` in every task; it is blocked in the
  task's threads and taken by a watcher thread (`sigwait`), so child processes (vLLM engine cores,
  the orchestrator) inherit it blocked and survive it. Global rank 0 then gives its entry up to
  `JobPlan.stop_grace_s` to return (the trainer checkpoints at the next step boundary) before it
  runs submitit's handler (checkpoint the dispatcher + `scontrol requeue`); a task whose entry
  returned because of the stop waits for the requeue instead of reporting success. Outside
  submitit (slurm/train.sbatch) the task records `"stopped": true` and exits; the batch script
  requeues.

Example: the time limit is 60 min, signal_delay_s=90: at 58:30 every task sees stop_requested, the
trainer finishes step k, saves checkpoints/step-(k+1) and returns; rank 0 requeues the job at once
(or at 59:30 at the latest, stop_grace_s=60); the requeued tasks start with attempt+1.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Tuple

from pipeline.launch.plan import JobPlan, LaunchError
from pipeline.launch.rendezvous import Rendezvous
from pipeline.run_files import LOGS_DIR, PLAN_FILE, RESULTS_DIR



@dataclass
class TaskInfo:
    """Everything a role's entry function learns about the task it runs in."""

    role: str  # the component this task belongs to
    rank: int  # rank within the role, 0 .. role_size-1
    role_size: int  # tasks of this role
    roles: Dict[str, int]  # every role of the run -> its task count, in launch order
    global_rank: int  # rank over all components (SLURM_PROCID order)
    world_size: int  # tasks over all components
    run_dir: Path  # the run directory (shared by every task)
    attempt: int  # 0 on the first start of the run, +1 per relaunch or requeue
    node: str  # Slurm node name (SLURMD_NODENAME) or the host name locally
    config: Dict[str, Any]  # JobPlan.config
    stop_requested: threading.Event = field(default_factory=threading.Event)  # set on preemption / time limit

    @property
    def resumed(self) -> bool:
        return self.attempt > 0

    @property
    def rendezvous(self) -> Rendezvous:
        return Rendezvous(self.run_dir, self.attempt)


def log_path(run_dir: Path, role: str, rank: int) -> Path:
    return Path(run_dir) / LOGS_DIR / f"{role}.{rank}.out"


def result_path(run_dir: Path, role: str, rank: int) -> Path:
    return Path(run_dir) / RESULTS_DIR / f"{role}.{rank}.json"


def locate(plan: JobPlan, environ: Mapping[str, str]) -> Tuple[int, str, int]:
    """(global rank, role, rank in role) of this task, from the launcher's environment."""
    layout = plan.task_layout()
    if "TOKENFLOW_GLOBAL_RANK" in environ:
        global_rank = int(environ["TOKENFLOW_GLOBAL_RANK"])
    elif "SLURM_PROCID" in environ:
        global_rank = int(environ["SLURM_PROCID"])
        het_size = int(environ.get("SLURM_HET_SIZE", "1"))
        if het_size != len(plan.components):
            raise LaunchError(f"the Slurm job has {het_size} het component(s) but the plan has "
                              f"{len(plan.components)} ({', '.join(plan.components)})")
        if het_size > 1:
            for k, (role, spec) in enumerate(plan.components.items()):
                got = int(environ.get(f"SLURM_NTASKS_HET_GROUP_{k}", "-1"))
                if got != spec.num_tasks:
                    raise LaunchError(f"het component {k} ({role}) has {got} tasks in Slurm, "
                                      f"the plan asks for {spec.num_tasks}")
    else:
        raise LaunchError("not started by a launcher: neither TOKENFLOW_GLOBAL_RANK nor SLURM_PROCID is set")
    if not 0 <= global_rank < len(layout):
        raise LaunchError(f"global rank {global_rank} is outside the plan's {len(layout)} tasks")
    role, rank = layout[global_rank]
    return global_rank, role, rank


def resolve_entry(entry: str) -> Callable[[TaskInfo], Any]:
    module_name, _, func_name = entry.partition(":")
    func = getattr(importlib.import_module(module_name), func_name, None)
    if not callable(func):
        raise LaunchError(f"entry {entry!r}: {module_name} has no callable {func_name!r}")
    return func


def _redirect_output(path: Path, header: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, header.encode())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _write_result(path: Path, record: Dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, default=str))
    os.replace(tmp, path)


class StopWatcher:
    """Turns the checkpoint signal into `task.stop_requested` (see the module docstring).

    The signal is blocked in the main thread (so child processes inherit it blocked) and caught two
    ways, whichever comes first: a thread in `sigwait` (when every thread blocks it) and a Python
    handler (when a thread that existed before, e.g. a BLAS pool, takes it: Python then runs the
    handler in the main thread at its next bytecode).
    """

    def __init__(self, event: threading.Event, requeue: Callable[[], None] | None, grace_s: float) -> None:
        self.event = event
        self.requeue = requeue  # submitit's checkpoint-and-requeue (rank 0 under submitit), else None
        self.grace_s = grace_s
        self.entry_returned = threading.Event()
        self._lock = threading.Lock()
        self.signum = checkpoint_signal()
        signal.signal(self.signum, lambda sig, frame: self._stop())
        signal.pthread_sigmask(signal.SIG_BLOCK, {self.signum})  # inherited by threads and child processes
        threading.Thread(target=self._watch, name="stop-watcher", daemon=True).start()

    def _watch(self) -> None:
        signal.sigwait({self.signum})
        self._stop()

    def _stop(self) -> None:
        with self._lock:
            if self.event.is_set():
                return
            print(f"tokenflow: checkpoint signal received at {time.strftime('%H:%M:%S')}: stopping", flush=True)
            self.event.set()
        if self.requeue is not None:
            threading.Thread(target=self._requeue_when_returned, name="requeue", daemon=True).start()

    def _requeue_when_returned(self) -> None:
        self.entry_returned.wait(self.grace_s)
        self.requeue()  # submitit: dumps the checkpointed dispatcher, scontrol requeue (ends every task)

    def after_entry(self) -> None:
        """Called when the entry returned: if it returned because of the stop, wait for the requeue."""
        self.entry_returned.set()
        if self.event.is_set() and _under_submitit():
            time.sleep(self.grace_s + 120)  # the requeue ends this task long before
            raise RuntimeError(f"stopped for requeue but the job was not requeued within {self.grace_s + 120:g} s")


def checkpoint_signal() -> int:
    """The signal that asks a task to stop for a requeue (submitit's choice: USR2 unless overridden)."""
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), signal.SIGUSR2)


def _under_submitit() -> bool:
    return "SUBMITIT_FOLDER" in os.environ


def _submitit_requeue(signum: int) -> Callable[[], None] | None:
    handler = signal.getsignal(signum)
    if not callable(handler):
        return None

    def requeue() -> None:
        try:
            handler(signum, None)
        except SystemExit:  # submitit exits after requeueing; in this thread that only ends the thread
            pass

    return requeue


def run_task(plan: JobPlan, run_dir: Path, launch_index: int, environ: Mapping[str, str]) -> Any:
    """Run this task's role entry; returns what the entry returned."""
    run_dir = Path(run_dir)
    global_rank, role, rank = locate(plan, environ)
    attempt = launch_index + int(environ.get("SLURM_RESTART_COUNT", "0"))
    node = environ.get("SLURMD_NODENAME") or socket.gethostname()
    _redirect_output(log_path(run_dir, role, rank),
                     f"=== {role}.{rank} attempt {attempt} global_rank {global_rank} on {node} "
                     f"pid {os.getpid()} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    result_file = result_path(run_dir, role, rank)
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    os.environ.update(plan.env)
    task = TaskInfo(role=role, rank=rank, role_size=plan.components[role].num_tasks,
                    roles={r: spec.num_tasks for r, spec in plan.components.items()}, global_rank=global_rank,
                    world_size=len(plan.task_layout()), run_dir=run_dir, attempt=attempt, node=node,
                    config=plan.config)
    watcher = None
    if threading.current_thread() is threading.main_thread():
        requeue = _submitit_requeue(checkpoint_signal()) if global_rank == 0 else None  # before StopWatcher replaces it
        watcher = StopWatcher(task.stop_requested, requeue, plan.stop_grace_s)
    try:
        value = resolve_entry(plan.components[role].entry)(task)
        if watcher is not None:
            watcher.after_entry()
    except BaseException as exc:
        if not isinstance(exc, SystemExit):  # SystemExit = submitit's requeue exit, not a failure
            _write_result(result_file, {"ok": False, "attempt": attempt, "node": node,
                                        "error": traceback.format_exc()})
            traceback.print_exc()
        raise
    _write_result(result_file, {"ok": True, "attempt": attempt, "node": node, "result": value,
                                "stopped": task.stop_requested.is_set()})
    sys.stdout.flush()
    return value


class RoleDispatcher:
    """The callable submitit runs in every task of the Slurm job (checkpointable: requeue re-runs it)."""

    def __init__(self, plan: JobPlan, run_dir: Path, launch_index: int) -> None:
        self.plan = plan
        self.run_dir = Path(run_dir)
        self.launch_index = launch_index

    def __call__(self) -> Any:
        return run_task(self.plan, self.run_dir, self.launch_index, os.environ)

    def checkpoint(self) -> Any:
        """submitit protocol: the job is requeued and this same dispatcher is called again."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)


def main(argv: list[str] | None = None) -> None:
    """Task entry: python -m pipeline.apps.launch_task RUN_DIR LAUNCH_INDEX (rank: TOKENFLOW_GLOBAL_RANK or SLURM_PROCID)."""
    run_dir, launch_index = (argv or sys.argv[1:])[:2]
    plan = JobPlan.from_json((Path(run_dir) / PLAN_FILE).read_text())
    run_task(plan, Path(run_dir), int(launch_index), os.environ)


if __name__ == "__main__":  # also `python -m pipeline.launch.task ...` (kept for callers of this module path)
    main()
