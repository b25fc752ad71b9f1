"""Checks of a JobPlan against what the Slurm cluster can give, before anything is submitted.

One `scontrol show partition -o` and one `scontrol show node -o` describe the cluster; `check_plan`
then names every problem at once, e.g.
    "trainer: partition 'gpu' does not exist (partitions: debug)"
    "generator: 8 CPUs per node (4 tasks x 2 cpus) but the largest node of 'debug' has 4"
A heterogeneous job's components never share a node (Slurm leaves such a job pending forever with
reason "Resources"), so the nodes of all components in one partition must fit in that partition's
usable nodes (not DOWN/DRAIN/FAIL) that meet every component's per-node needs.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from pipeline.launch.plan import ComponentSpec, JobPlan, LaunchError

_UNUSABLE = ("DOWN", "DRAIN", "FAIL", "INVAL", "FUTURE", "NOT_RESPONDING")


@dataclass
class SlurmPartition:
    name: str
    default: bool
    up: bool
    max_time_min: Optional[int]  # None = unlimited
    max_nodes: Optional[int]  # None = unlimited
    grace_s: int = 0  # GraceTime: seconds a preempted job's tasks get between SIGTERM and SIGKILL
    preempt_mode: str = "OFF"  # PreemptMode (OFF: its jobs are never preempted; REQUEUE, CANCEL, ...)


@dataclass
class SlurmNode:
    name: str
    cpus: int
    mem_mb: int
    gpus: int
    state: str
    partitions: List[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return not any(bad in self.state.upper() for bad in _UNUSABLE)


def _scontrol(*args: str) -> str:
    try:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot query Slurm (scontrol {' '.join(args)}): {exc}") from exc
    if out.returncode != 0:
        raise LaunchError(f"cannot query Slurm (scontrol {' '.join(args)}): {out.stderr.strip()}")
    return out.stdout


def _fields(line: str) -> Dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", line))


def parse_time_min(text: str) -> Optional[int]:
    """Slurm time limit ('UNLIMITED', 'MM', 'HH:MM:SS', 'D-HH:MM:SS') in minutes; None = unlimited."""
    if text.upper() in ("UNLIMITED", "INFINITE", "NONE", ""):
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if len(parts) == 1:
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, s = 0, parts[0], parts[1]
    else:
        h, m, s = parts
    return (int(days or 0) * 24 + h) * 60 + m + (1 if s else 0)


def _gpu_count(gres: str) -> int:
    total = 0
    for item in gres.split(","):
        item = re.sub(r"\(.*?\)", "", item)
        if item.startswith("gpu"):
            tail = item.rsplit(":", 1)[-1]
            total += int(tail) if tail.isdigit() else 1
    return total


def query_cluster() -> Tuple[Dict[str, SlurmPartition], List[SlurmNode]]:
    partitions = {}
    for line in _scontrol("show", "partition", "-o").splitlines():
        f = _fields(line)
        if "PartitionName" not in f:
            continue
        max_nodes = f.get("MaxNodes", "UNLIMITED")
        partitions[f["PartitionName"]] = SlurmPartition(
            name=f["PartitionName"], default=f.get("Default") == "YES", up=f.get("State") == "UP",
            max_time_min=parse_time_min(f.get("MaxTime", "UNLIMITED")),
            max_nodes=int(max_nodes) if max_nodes.isdigit() else None,
            grace_s=int(f.get("GraceTime", "0") or 0), preempt_mode=f.get("PreemptMode", "OFF"))
    nodes = []
    for line in _scontrol("show", "node", "-o").splitlines():
        f = _fields(line)
        if "NodeName" not in f:
            continue
        nodes.append(SlurmNode(name=f["NodeName"], cpus=int(f.get("CPUTot", 0)), mem_mb=int(f.get("RealMemory", 0)),
                               gpus=_gpu_count(f.get("Gres", "")), state=f.get("State", "UNKNOWN"),
                               partitions=[p for p in f.get("Partitions", "").split(",") if p]))
    return partitions, nodes


def _fits(node: SlurmNode, spec: ComponentSpec) -> bool:
    return (node.usable and node.cpus >= spec.tasks_per_node * spec.cpus_per_task
            and node.mem_mb >= spec.mem_gb * 1024 and node.gpus >= spec.gpus_per_node)


def check_plan(plan: JobPlan, partitions: Dict[str, SlurmPartition], nodes: List[SlurmNode]) -> None:
    """Raise LaunchError listing every request of `plan` the cluster cannot satisfy."""
    problems = []
    default = next((p.name for p in partitions.values() if p.default), None)
    nodes_by_partition: Dict[str, List[Tuple[str, ComponentSpec]]] = {}
    for role, spec in plan.components.items():
        name = spec.partition or default
        if name is None:
            problems.append(f"{role}: no partition given and the cluster has no default partition")
            continue
        part = partitions.get(name)
        if part is None:
            problems.append(f"{role}: partition {name!r} does not exist (partitions: {', '.join(sorted(partitions))})")
            continue
        nodes_by_partition.setdefault(name, []).append((role, spec))
        members = [n for n in nodes if name in n.partitions]
        if not part.up:
            problems.append(f"{role}: partition {name!r} is not UP")
        if part.max_time_min is not None and spec.time_min > part.max_time_min:
            problems.append(f"{role}: time_min={spec.time_min} exceeds {name!r} MaxTime of {part.max_time_min} min")
        if part.max_nodes is not None and spec.nodes > part.max_nodes:
            problems.append(f"{role}: nodes={spec.nodes} exceeds {name!r} MaxNodes={part.max_nodes}")
        cpus = spec.tasks_per_node * spec.cpus_per_task
        for need, have, what, unit in (
                (cpus, max((n.cpus for n in members), default=0),
                 f"{cpus} CPUs per node ({spec.tasks_per_node} tasks x {spec.cpus_per_task} cpus)", "CPUs"),
                (spec.mem_gb * 1024, max((n.mem_mb for n in members), default=0),
                 f"{spec.mem_gb:g} GB memory per node", "MB"),
                (spec.gpus_per_node, max((n.gpus for n in members), default=0),
                 f"{spec.gpus_per_node} GPUs per node", "GPUs")):
            if need > have:
                problems.append(f"{role}: {what} but the largest node of {name!r} has {have:g} {unit}")
    for name, specs in nodes_by_partition.items() if not problems else ():  # per-component problems first
        fitting = [n for n in nodes if name in n.partitions and all(_fits(n, s) for _, s in specs)]
        wanted = sum(s.nodes for _, s in specs)
        if wanted > len(fitting):
            roles = ", ".join(f"{r}={s.nodes}" for r, s in specs)
            problems.append(f"partition {name!r}: the components need {wanted} distinct nodes ({roles}) but only "
                            f"{len(fitting)} usable node(s) fit them (heterogeneous components never share a node)")
    if problems:
        raise LaunchError("the cluster cannot run this plan: " + "; ".join(problems))
