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
  Slurm requeues of this job (`SLURM_RESTART_COUNT`); `resumed` is `attempt > 0`; the tasks of a
  generator job that joins a running run take that run's current attempt (`JOINS_RUN`);
- the task process is a supervisor (`pipeline.launch.supervisor`): it runs the role in a child
  process (`ROLE_PROCESS_ENV` set), ends whatever the role leaves behind, and restarts the role
  where the component allows it;
- the stop signals, SIGTERM (preemption, scancel) and the checkpoint signal (USR2: Slurm sends it
  `signal_delay_s` before the time limit, and `SlurmRun.preempt()` sends it), set
  `task.stop_requested` in the role; the checkpoint signal is blocked in the role's threads and
  taken by a watcher thread (`sigwait`), so its child processes (vLLM engine cores, the
  orchestrator) inherit it blocked and survive it. On the checkpoint signal, global rank 0's
  supervisor gives the role up to `JobPlan.stop_grace_s` to return (the trainer checkpoints at the
  next step boundary) before it runs submitit's handler (checkpoint the dispatcher + `scontrol
  requeue`); a task whose role returned because of the stop waits for the requeue instead of
  reporting success. SIGTERM never requeues (Slurm's preemption requeues by itself; scancel
  cancels). Outside submitit (slurm/train.sbatch) the task records `"stopped": true` and exits; the
  batch script requeues.

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

from pipeline.generator.owner_watch import release_rpc_dir
from pipeline.launch.gpus import task_gpu_env
from pipeline.launch.plan import JobPlan, LaunchError
from pipeline.launch.rendezvous import DIST_ENV, Rendezvous, mpi_bootstrap, under_mpi
from pipeline.launch.supervisor import ROLE_PROCESS_ENV, RoleFailed, TaskSupervisor, role_argv
from pipeline.supervise import become_subreaper, end_tree, own_resource_trackers, signal_note
from pipeline.run_files import LOGS_DIR, PLAN_FILE, RESULTS_DIR
from pipeline.weights.guarded_groups import ADDRESS_ENV


PLAN_ENV = "TOKENFLOW_PLAN"
"""The plan a task reads, relative to the run directory (default `PLAN_FILE`; a generator job that
joins a running run has its own, `pipeline.launch.generator_jobs`); set in ``JobPlan.env``."""
JOINS_RUN = "joins_run"
"""Key of ``JobPlan.config``: true for a job that joins a running run (its tasks take the run's
current attempt, `rendezvous.running_attempt`, instead of counting launches)."""
REQUEUES = "requeues"
"""Key of ``JobPlan.config`` (default true): false for a job that ends at its checkpoint signal
(time limit, preemption) instead of being requeued; its tasks exit 0 once their role returned
(a generator job departs for good: `pipeline.launch.generator_jobs`)."""


RESTART_NOTICES = {"generator": "pipeline.roles.generator:predecessor_left"}
"""role -> ``module:function(run_dir, rank)`` its task's supervisor calls before it restarts the role:
the run learns at once that the dead process is gone (`TaskSupervisor.on_restart`)."""


@dataclass
class TaskInfo:
    """Everything a role's entry function learns about the task it runs in."""

    role: str  # the component this task belongs to
    rank: int  # rank within the role: first_rank .. first_rank+role_size-1 (first_rank 0 but in a generator job joining a run)
    role_size: int  # tasks of this role
    roles: Dict[str, int]  # every role of the run -> its task count, in launch order
    global_rank: int  # rank over all components (SLURM_PROCID order)
    world_size: int  # tasks over all components
    run_dir: Path  # the run directory (shared by every task)
    attempt: int  # 0 on the first start of the run, +1 per relaunch or requeue
    node: str  # Slurm node name (SLURMD_NODENAME) or the host name locally
    config: Dict[str, Any]  # JobPlan.config
    stop_requested: threading.Event = field(default_factory=threading.Event)  # set on preemption / time limit
    restart: int = 0  # restarts of this task's role process in place (by its supervisor) before this one

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


def abandoned_tasks(run_dir: Path, role: str, count: int) -> int:
    """How many of the ``count`` tasks of ``role`` abandoned (their restarts used up; see supervisor)."""
    n = 0
    for rank in range(count):
        try:
            n += bool(json.loads(result_path(run_dir, role, rank).read_text()).get("abandoned"))
        except (FileNotFoundError, ValueError):
            pass
    return n


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
    """Turns the stop signals into `task.stop_requested` in the role process (module docstring).

    The checkpoint signal is blocked in the main thread (so child processes inherit it blocked) and
    caught two ways, whichever comes first: a thread in `sigwait` (when every thread blocks it) and
    a Python handler (when a thread that existed before, e.g. a BLAS pool, takes it: Python then
    runs the handler in the main thread at its next bytecode). SIGTERM gets a Python handler only:
    child processes start with its default action.
    """

    def __init__(self, event: threading.Event) -> None:
        self.event = event
        self._lock = threading.RLock()  # re-entrant: a second signal's handler may run inside the first
        self.signum = checkpoint_signal()
        for sig in (self.signum, signal.SIGTERM):
            signal.signal(sig, lambda s, frame: self._stop(s))
        signal.pthread_sigmask(signal.SIG_BLOCK, {self.signum})  # inherited by threads and child processes
        threading.Thread(target=self._watch, name="stop-watcher", daemon=True).start()

    def _watch(self) -> None:
        self._stop(signal.sigwait({self.signum}))

    def _stop(self, sig: int) -> None:
        # Runs in the main thread for a Python handler, where a second SIGTERM (``kill`` of the process
        # group and the supervisor's forward of it) can interrupt the first between two bytecodes:
        # the event is set before anything slow, and the note is written unbuffered (a `print` there
        # could meet the interrupted `print`'s buffer: "reentrant call").
        with self._lock:
            if self.event.is_set():
                return
            self.event.set()
        signal_note(f"tokenflow: {signal.Signals(sig).name} received at {time.strftime('%H:%M:%S')}: stopping")



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
    """Run this task: the supervisor, or (in its child, `ROLE_PROCESS_ENV` set) the role entry."""
    run_dir = Path(run_dir)
    global_rank, role, rank = locate(plan, environ)
    attempt = launch_index + int(environ.get("SLURM_RESTART_COUNT", "0"))
    if plan.config.get(JOINS_RUN):  # a generator job joining a running run takes part in its attempt
        from pipeline.launch.rendezvous import running_attempt
        attempt = running_attempt(run_dir, timeout_s=float(plan.config.get("timeout_s", 0)))
    node = environ.get("SLURMD_NODENAME") or socket.gethostname()
    result_file = result_path(run_dir, role, rank)
    if ROLE_PROCESS_ENV in environ:
        return _run_role(plan, run_dir, (global_rank, role, rank), attempt, node, result_file)
    _redirect_output(log_path(run_dir, role, rank),
                     f"=== {role}.{rank} attempt {attempt} global_rank {global_rank} on {node} "
                     f"supervisor pid {os.getpid()} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    spec = plan.components[role]
    requeues = _under_submitit() and plan.config.get(REQUEUES, True)
    requeue = _submitit_requeue(checkpoint_signal()) if global_rank == 0 and requeues else None
    env = {**environ, "TOKENFLOW_GLOBAL_RANK": str(global_rank), **_mpi_dist_env(plan, role, rank, node)}
    boot = json.loads(env.get(DIST_ENV, "{}"))
    notice = RESTART_NOTICES.get(role)
    supervisor = TaskSupervisor(role_argv(run_dir, launch_index), env, result_file,
                                spec.max_restarts, spec.optional, plan.stop_grace_s, requeue,
                                wait_for_requeue=requeues, pass_fds=(boot["listen_fd"],) if "listen_fd" in boot else (),
                                on_restart=(lambda: resolve_entry(notice)(run_dir, rank)) if notice else None)
    code = supervisor.run((signal.SIGTERM, checkpoint_signal()))
    if code != 0:
        record = json.loads(result_file.read_text()) if result_file.exists() else {}
        raise RoleFailed(f"{role}.{rank} failed: " + (record.get("error") or "no result").strip().splitlines()[-1])
    record = json.loads(result_file.read_text())
    return record.get("result")


def _mpi_dist_env(plan: JobPlan, role: str, rank: int, node: str) -> Dict[str, str]:
    """Under an MPI launch (`plan.mpi`, e.g. srun --mpi=pmix): this component's rank, size and master
    address from MPI (`mpi_bootstrap`, every task of the step takes part) as DIST_ENV for the role;
    without PMI in the environment, nothing (the roles use the file rendezvous)."""
    if not plan.mpi:
        return {}
    if not under_mpi():
        print(f"plan.mpi={plan.mpi} but this task was not launched under MPI: file rendezvous", flush=True)
        return {}
    roles = list(plan.components)
    host = plan.env.get(ADDRESS_ENV, node)  # cluster.network.address: rank 0's store listens there only
    got = mpi_bootstrap(roles.index(role), rank, plan.components[role].num_tasks, host)
    print(f"MPI bootstrap: {role} rank {got['rank']} of {got['size']}, master {got['host']}:{got['port']}", flush=True)
    return {DIST_ENV: json.dumps(got)}


def _run_role(plan: JobPlan, run_dir: Path, where: Tuple[int, str, int], attempt: int, node: str,
              result_file: Path) -> Any:
    global_rank, role, rank = where
    restart = int(os.environ[ROLE_PROCESS_ENV])
    print(f"--- {role}.{rank} role process pid {os.getpid()} (restart {restart}) at "
          f"{time.strftime('%Y-%m-%dT%H:%M:%S')}", flush=True)
    become_subreaper()  # orphans of its children (an engine's worker) stay in its tree, ended at exit
    result_file.unlink(missing_ok=True)
    os.environ.update(plan.env)
    task = TaskInfo(role=role, rank=rank, role_size=plan.components[role].num_tasks,
                    roles={r: spec.num_tasks for r, spec in plan.components.items()}, global_rank=global_rank,
                    world_size=len(plan.task_layout()), run_dir=run_dir, attempt=attempt, node=node,
                    config=plan.config, restart=restart)
    StopWatcher(task.stop_requested)
    try:
        os.environ.update(task_gpu_env(plan, role, rank, os.environ))  # before any CUDA state (gpus.py)
        value = resolve_entry(plan.components[role].entry)(task)
    except BaseException:
        _write_result(result_file, {"ok": False, "attempt": attempt, "node": node, "restart": restart,
                                    "error": traceback.format_exc()})
        traceback.print_exc()
        end_tree(spare=own_resource_trackers())  # it ends with this process (shared memory cleaned)
        release_rpc_dir()  # its engine's socket directory too: no atexit past os._exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # a failed role's library threads (vLLM, ZeroMQ) could hold the interpreter's exit
    end_tree(spare=own_resource_trackers())
    _write_result(result_file, {"ok": True, "attempt": attempt, "node": node, "restart": restart,
                                "result": value, "stopped": task.stop_requested.is_set()})
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
    plan = JobPlan.from_json((Path(run_dir) / os.environ.get(PLAN_ENV, PLAN_FILE)).read_text())
    try:
        run_task(plan, Path(run_dir), int(launch_index), os.environ)
    except RoleFailed as exc:
        print(f"tokenflow supervisor: {exc}", flush=True)
        sys.exit(1)
    if ROLE_PROCESS_ENV in os.environ:  # the role is done and its result written: leave now (library
        sys.stdout.flush()               # threads must not hold the exit; the supervisor waits on it)
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":  # also `python -m pipeline.launch.task ...` (kept for callers of this module path)
    main()
