"""SlurmLauncher: the whole plan as ONE heterogeneous Slurm job, submitted through submitit.

submitit has no heterogeneous-job support; this module adds the missing pieces:
- component 0's resources are submitit's own parameters; components 1..k are written into
  submitit's `setup` lines, which it places right after its `#SBATCH` block, so sbatch still reads
  them as directives ("#SBATCH hetjob" starts each new component);
- srun gets `--het-group=0,...,k` (one step over every component, SLURM_PROCID numbered component
  after component) and `--kill-on-bad-exit=1` (a task that fails takes the step down: no hang; a
  task's supervisor restarts a dead generator role in place first, and an optional task that used
  up its restarts exits 0, so the job goes on without it: see pipeline.launch.supervisor);
- submitit counts tasks from component 0 only: `HetSlurmExecutor` reports the plan's total;
- sacct reports a heterogeneous job N as rows `N+0`, `N+1`, ...; submitit's watcher only knows `N`,
  so `HetInfoWatcher` folds the component rows into one state for `N` (see `fold_states`);
- the submitit folder is `RUN/submitit` (no `%j` in it: per-component job ids would split it).

Worked example: components trainer(nodes=1) and generator(nodes=2) give a script with
    #SBATCH --nodes=1 ... (submitit's block, component 0)
    #SBATCH hetjob
    #SBATCH --nodes=2 --ntasks-per-node=1 ... (component 1)
    trap 'true' TERM                          (`OUTLIVE_SRUN`)
    srun ... --het-group=0,1 --kill-on-bad-exit=1 python -m submitit.core._submit RUN/submitit
and SLURM_PROCID 0 is trainer.0, 1..2 are generator.0..1.

Preemption/time limit: the checkpoint signal stops every role (see pipeline.launch.task); rank 0 then
runs submitit's handler, which calls `RoleDispatcher.checkpoint()` and requeues the job; the requeued
tasks see SLURM_RESTART_COUNT+1 as their attempt. Preemption by Slurm (`PreemptMode=REQUEUE`) sends
SIGTERM: every role stops the same way (the trainer checkpoints at its step boundary) and exits 0,
and Slurm requeues the job itself; no task requeues on SIGTERM (scancel sends it too).
"""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Sequence

from submitit.core.utils import FailedJobError
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from pipeline.launch.base import LINGER_S, Launcher, Run
from pipeline.launch.plan import ComponentSpec, JobPlan, LaunchError
from pipeline.launch.slurm_checks import check_plan, query_cluster
from pipeline.launch.task import RoleDispatcher
from pipeline.run_files import SUBMITIT_DIR

# Slurm states in which a job may still run tasks (everything else is final).
ACTIVE_STATES = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
                 "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "PREEMPTED", "RESV_DEL_HOLD")


def fold_states(states: Sequence[str]) -> str:
    """One state for a heterogeneous job from its components' states.

    Any active component keeps the job active (that state wins); otherwise the first component not
    COMPLETED (FAILED, CANCELLED, TIMEOUT, ...) names the outcome; otherwise COMPLETED.
    """
    for state in states:
        if state.split()[0] in ACTIVE_STATES:
            return state
    return next((s for s in states if not s.startswith("COMPLETED")), states[0] if states else "UNKNOWN")


class HetInfoWatcher(SlurmInfoWatcher):
    """submitit's sacct watcher, taught that rows `N+k` are the components of job `N`."""

    def read_info(self, string: Any) -> Dict[str, Dict[str, str]]:
        info = super().read_info(string)
        components: Dict[str, List[tuple]] = {}
        for job_id, stats in info.items():
            main, plus, offset = job_id.partition("+")
            if plus and offset.isdigit():
                components.setdefault(main, []).append((int(offset), stats))
        for main, rows in components.items():
            rows.sort(key=lambda r: r[0])
            info[main] = {**rows[0][1], "JobID": main, "State": fold_states([r[1]["State"] for r in rows]),
                          "NodeList": ",".join(r[1].get("NodeList", "") for r in rows)}
        return info


class HetSlurmJob(SlurmJob):
    watcher = HetInfoWatcher(delay_s=5)


class HetSlurmExecutor(SlurmExecutor):
    """SlurmExecutor whose job counts the tasks of every component."""

    job_class = HetSlurmJob

    def __init__(self, folder: Path, total_tasks: int, **kwargs: Any) -> None:
        super().__init__(folder, **kwargs)
        self.total_tasks = total_tasks

    def _num_tasks(self) -> int:
        return self.total_tasks


def component_directives(spec: ComponentSpec) -> List[str]:
    """sbatch options of one component (used for components 1..k; component 0 goes through submitit)."""
    opts = [f"--nodes={spec.nodes}", f"--ntasks-per-node={spec.tasks_per_node}",
            f"--cpus-per-task={spec.cpus_per_task}", f"--mem={int(spec.mem_gb * 1024)}M", f"--time={spec.time_min}"]
    if spec.gpus_per_node:
        opts.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.partition:
        opts.append(f"--partition={spec.partition}")
    if spec.account:
        opts.append(f"--account={spec.account}")
    return opts + list(spec.extra_sbatch)


OUTLIVE_SRUN = "trap 'true' TERM"
"""The job script's last setup line: on SIGTERM (a cancel, a preemption) the script waits for its
srun instead of dying at once. Slurm ends a cancelled job with SIGTERM, then SIGKILL after
``KillWait`` to the processes it tracks; a tracker that follows parent links (proctrack/linuxproc)
no longer finds an srun whose script died first, and an srun that does not end on SIGTERM (Slurm
22.05's srun of a het step under PMIx, stuck after its tasks exited) then outlived the job
(`tests/launch/test_slurm_cluster.py`). A trap that runs a command is not inherited: srun keeps
its own SIGTERM handling."""


def executor_parameters(plan: JobPlan) -> Dict[str, Any]:
    """submitit parameters for the whole heterogeneous job."""
    first, *rest = plan.components.values()
    setup = [f"#SBATCH {opt}" for opt in first.extra_sbatch]
    for spec in rest:
        setup.append("#SBATCH hetjob")
        setup += [f"#SBATCH {opt}" for opt in component_directives(spec)]
    setup += [f"export {k}={shlex.quote(v)}" for k, v in plan.env.items()]
    setup.append(OUTLIVE_SRUN)
    srun_args = ["--kill-on-bad-exit=1"]
    if rest:
        srun_args.append("--het-group=" + ",".join(str(k) for k in range(len(plan.components))))
    if plan.mpi:
        srun_args.append(f"--mpi={plan.mpi}")
    params: Dict[str, Any] = dict(
        job_name=plan.name, nodes=first.nodes, ntasks_per_node=first.tasks_per_node,
        cpus_per_task=first.cpus_per_task, mem=f"{int(first.mem_gb * 1024)}M", time=first.time_min,
        signal_delay_s=plan.signal_delay_s, setup=setup, srun_args=srun_args)
    if first.gpus_per_node:
        params["gpus_per_node"] = first.gpus_per_node
    if first.partition:
        params["partition"] = first.partition
    if first.account:
        params["account"] = first.account
    return params


class SlurmRun(Run):
    def __init__(self, plan: JobPlan, run_dir: Path, launch_index: int, job: HetSlurmJob) -> None:
        super().__init__(plan, run_dir, launch_index)
        self.job = job
        self.job_id = job.job_id

    def state(self) -> str:
        return self.job.watcher.get_state(self.job_id, mode="force")

    def done(self) -> bool:
        return self.job.watcher.is_done(self.job_id, mode="force")

    def cancel(self) -> None:
        self.job.cancel(check=False)

    def requeue(self) -> None:
        """Requeue the running job now (what preemption does): every task stops and starts again."""
        out = subprocess.run(["scontrol", "requeue", self.job_id], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise LaunchError(f"scontrol requeue {self.job_id} failed: {out.stderr.strip()}")

    def preempt(self) -> None:
        """Send the checkpoint signal (USR2) as Slurm does `signal_delay_s` before the time limit: every
        task sees stop_requested, the trainer checkpoints, rank 0 requeues the job through submitit."""
        out = subprocess.run(["scancel", "--signal=USR2", self.job_id], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise LaunchError(f"scancel --signal=USR2 {self.job_id} failed: {out.stderr.strip()}")

    def wait(self, timeout_s: float, poll_s: float = 1.0, linger_s: float = LINGER_S) -> Dict[str, List[Any]]:
        return super().wait(timeout_s, poll_s, linger_s)


class SlurmLauncher(Launcher):
    """Submit a plan as one heterogeneous job; `python` is the command tasks start Python with."""

    name = "slurm"

    def __init__(self, python: str | None = None) -> None:
        self.python = python

    def check(self, plan: JobPlan) -> None:
        partitions, nodes = query_cluster()
        check_plan(plan, partitions, nodes)

    def _start(self, plan: JobPlan, run_dir: Path, launch_index: int) -> SlurmRun:
        executor = HetSlurmExecutor(run_dir / SUBMITIT_DIR, total_tasks=len(plan.task_layout()),
                                    max_num_timeout=plan.max_requeues, python=self.python)
        executor.update_parameters(**executor_parameters(plan))
        try:
            job = executor.submit(RoleDispatcher(plan, run_dir, launch_index))
        except FailedJobError as exc:
            raise LaunchError(f"sbatch refused the job: {str(exc).strip()}") from exc
        return SlurmRun(plan, run_dir, launch_index, job)


def slurm_states(job_id: str) -> dict[int, dict[str, str]]:
    """het offset -> {state, nodes, reason} of job `job_id` (a plain job is offset 0)."""
    out: dict[int, dict[str, str]] = {}
    sacct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State,NodeList"],
                           capture_output=True, text=True, timeout=30)
    for line in sacct.stdout.splitlines():
        jid, state, nodes = (line.split("|") + ["", "", ""])[:3]
        main, _, offset = jid.partition("+")
        if main == job_id and (offset.isdigit() or not offset):
            out[int(offset or 0)] = {"state": state.split()[0] if state else "UNKNOWN", "nodes": nodes, "reason": ""}
    squeue = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i|%T|%r|%N"], capture_output=True, text=True,
                            timeout=30)
    for line in squeue.stdout.splitlines():
        jid, state, reason, nodes = (line.split("|") + ["", "", "", ""])[:4]
        main, _, offset = jid.partition("+")
        entry = out.setdefault(int(offset or 0), {"state": state, "nodes": nodes, "reason": ""})
        entry.update(state=state, reason="" if reason in ("None", "") else reason, nodes=nodes or entry["nodes"])
    return out
