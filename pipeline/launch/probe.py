"""The probe role: checks where tasks landed, that roles find each other, and MPI, without a model.

Point any component's `entry` at "pipeline.launch.probe:probe" to check a cluster before a real run
(the launch tests do exactly this). Behaviour comes from `task.config["probe"]` (all optional):
    rendezvous: bool   rank 0 of every role publishes {"role", "node"} under its role name,
                       every task waits (timeout_s) for every role's entry and reports what it read
    mpi: bool          the plan is launched under MPI (plan.mpi, srun --mpi=pmix): the report holds
                       the rank, size and master address the task's supervisor got from MPI, and
                       the component's tasks form a gloo process group from them (rank 0 serving
                       its store on the socket the supervisor bound) and all-reduce
                       their rank + 1 (the report's "allreduce": size*(size+1)/2 if it formed)
    hold_s: float      on attempts below `hold_until_attempt` (default 1) wait up to hold_s
                       seconds for the stop signal or a requeue (for preemption tests): return
                       when stopped (as a role returns after checkpointing), fail if never
    deaf_role: str     tasks of this role hold on for all of hold_s after the stop signal too (a
                       role that never reaches a step boundary: for cancel tests)
    fail_role: str     tasks of this role raise before the rendezvous (for failure-handling tests)
    crash_role: str, crash_times: int   the role process of tasks of this role starts a child
                       process (standing in for a vLLM engine; its pid is in the report as
                       "child_pid"), then kills itself with SIGKILL, on its first crash_times
                       starts (for supervision tests: restarts in place, nothing left behind)
    reach: dict        a `NetworkConfig` as a dict (`tokenflow doctor --probe`): every task listens on
                       its node's chosen address (`pipeline.launch.network.listen_address`), publishes
                       it, then connects to every task's; the report's "listened" is its address,
                       "reach" maps each peer ("role.rank") to "ok" or the error
    timeout_s: float   rendezvous timeout (default 60)
Each task writes its report to RUN/probe/<role>.<rank>.attempt-<n>.json and returns it, e.g.
    {"role": "generator", "rank": 1, "node": "node3", "attempt": 0, "peers": {"trainer": {...}}, ...}
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict

from pipeline.launch.rendezvous import DIST_ENV, bootstrap_store
from pipeline.launch.task import TaskInfo


def probe(task: TaskInfo) -> Dict[str, Any]:
    options = task.config.get("probe", {})
    timeout_s = float(options.get("timeout_s", 60))
    report: Dict[str, Any] = {
        "role": task.role, "rank": task.rank, "role_size": task.role_size, "global_rank": task.global_rank,
        "world_size": task.world_size, "node": task.node, "host": socket.gethostname(), "pid": os.getpid(),
        "attempt": task.attempt, "resumed": task.resumed, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "het_size": os.environ.get("SLURM_HET_SIZE"), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "local_rank": os.environ.get("LOCAL_RANK")}
    print(f"probe {task.role}.{task.rank} on {task.node} attempt {task.attempt}", flush=True)
    if options.get("crash_role") == task.role:
        _crash_with_a_child(task, report, int(options.get("crash_times", 1)))
    if options.get("fail_role") == task.role:
        raise RuntimeError(f"probe: role {task.role} was told to fail")
    if options.get("rendezvous"):
        if task.rank == 0:
            task.rendezvous.publish(task.role, {"role": task.role, "node": task.node})
        report["peers"] = {role: task.rendezvous.wait(role, timeout_s) for role in task.roles}
    if options.get("reach") is not None:
        report["listened"], report["reach"] = _reach_every_task(task, options["reach"], timeout_s)
    if options.get("mpi"):
        if DIST_ENV not in os.environ:
            raise RuntimeError("probe.mpi is set but the supervisor got nothing from MPI (not launched under PMIx?)")
        report["mpi"] = json.loads(os.environ[DIST_ENV])
        report["allreduce"] = _allreduce_rank(report["mpi"], timeout_s)
    out = task.run_dir / "probe" / f"{task.role}.{task.rank}.attempt-{task.attempt}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report))
    if task.attempt < int(options.get("hold_until_attempt", 1)) and options.get("hold_s"):
        deadline = time.monotonic() + float(options["hold_s"])
        deaf = options.get("deaf_role") == task.role
        while (deaf or not task.stop_requested.is_set()) and time.monotonic() < deadline:
            time.sleep(0.2)  # a role's main thread returns to Python often: signal handlers run there
        if not task.stop_requested.is_set():
            raise RuntimeError(f"probe: held {options['hold_s']} s on attempt {task.attempt} and was not stopped")
        report["stop_requested"] = True  # a real role would checkpoint here, then return
        out.write_text(json.dumps(report))
    return report


def _reach_every_task(task: TaskInfo, network: Dict[str, Any], timeout_s: float) -> tuple[str, Dict[str, str]]:
    """Listen on this node's chosen address, publish it, connect to every task's (see the docstring);
    the address listened on, and peer -> "ok" or the error."""
    from pipeline.launch.network import NetworkConfig, listen_address
    from pipeline.launch.rendezvous import listen_on

    address = listen_address(NetworkConfig(**network), socket.gethostname())
    listener = listen_on(address)
    me = f"{task.role}.{task.rank}"
    task.rendezvous.publish(f"reach-{me}", {"address": address, "port": listener.getsockname()[1]})
    accepted = threading.Thread(target=_accept_all, args=(listener, task.world_size, timeout_s), daemon=True)
    accepted.start()
    outcome = {}
    for role, count in task.roles.items():
        for rank in range(count):
            peer = task.rendezvous.wait(f"reach-{role}.{rank}", timeout_s)
            try:
                with socket.create_connection((peer["address"], peer["port"]), timeout=timeout_s):
                    outcome[f"{role}.{rank}"] = "ok"
            except OSError as exc:
                outcome[f"{role}.{rank}"] = f"{peer['address']}:{peer['port']}: {exc}"
    accepted.join(timeout_s)  # every task connected to this one (or the time is up): close it
    listener.close()
    return address, outcome


def _accept_all(listener: socket.socket, count: int, timeout_s: float) -> None:
    listener.settimeout(timeout_s)
    for _ in range(count):
        try:
            listener.accept()[0].close()
        except OSError:
            return


def _allreduce_rank(dist: Dict[str, Any], timeout_s: float) -> int:
    import datetime

    import torch
    import torch.distributed as tdist

    tdist.init_process_group("gloo", store=bootstrap_store(dist, timeout_s), rank=dist["rank"],
                             world_size=dist["size"], timeout=datetime.timedelta(seconds=timeout_s))
    value = torch.tensor([dist["rank"] + 1])
    tdist.all_reduce(value)
    tdist.destroy_process_group()
    return int(value.item())


def _crash_with_a_child(task: TaskInfo, report: Dict[str, Any], times: int) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    report["child_pid"] = child.pid
    out = task.run_dir / "probe" / f"{task.role}.{task.rank}.restart-{task.restart}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report))
    if task.restart < times:
        os.kill(os.getpid(), signal.SIGKILL)
