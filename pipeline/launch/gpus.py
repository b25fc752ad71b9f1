"""Which GPUs each task of a run uses: disjoint slices per component on a node, Slurm's own
binding on Slurm, and nothing at all for a task that asks for none.

Invariants:
- locally every component runs on this node: component k's tasks take the node's GPUs from
  ``ComponentSpec.gpu_first`` on, which `local_gpu_layout` sets past the GPUs of the components
  before it, so no two components share a GPU unless co-located on purpose (one GPU, weights
  handed over by CUDA IPC: the generator sits on trainer rank 0's GPU);
- on Slurm a task's GPUs are those Slurm bound to its step (``CUDA_VISIBLE_DEVICES`` as Slurm's
  gres plugin set it), cut by ``SLURM_LOCALID`` (the task's index on its node, whatever the
  distribution) when Slurm bound the whole node's GPUs to every task of the step;
- an empty slice means no GPU: the task gets ``CUDA_VISIBLE_DEVICES=""``; ``LOCAL_RANK`` is
  always 0 (a task sees only its own slice, and the trainer's `torch.cuda.set_device` reads it);
- `task_gpu_env` runs before the role's entry function, so before any thread of the task creates
  CUDA state.

Worked example: locally on a 4-GPU node, 2 trainer ranks and 2 generators with one GPU each:
trainer ranks 0, 1 get GPUs 0, 1 (gpu_first 0), generators 0, 1 get 2, 3 (gpu_first 2). On Slurm,
2 nodes x 2 tasks with gpus_per_node=4 under cyclic distribution: ranks 0 and 2 are on node A with
SLURM_LOCALID 0 and 1, so they get [0, 1] and [2, 3]; the block assumption (rank % tasks_per_node)
would have given rank 2 [0, 1] as well.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Mapping

from pipeline.launch.plan import ComponentSpec, JobPlan, LaunchError

LAUNCHER_ENV = "TOKENFLOW_LAUNCHER"
"""Set in ``JobPlan.env`` by `Launcher.launch`: "local" or "slurm" (which rule places GPUs)."""


def node_gpu_count() -> int:
    """NVIDIA GPUs of this machine that this process may use: ``CUDA_VISIBLE_DEVICES`` when set,
    else ``nvidia-smi -L``, else the ``/dev/nvidia<N>`` device files (0 on a CPU machine)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip()])
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            if out.returncode == 0:
                return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.TimeoutExpired):
            pass
    return sum(1 for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))


def gpus_per_task(spec: ComponentSpec) -> int:
    """GPUs each task of ``spec`` gets (an equal share of its node's)."""
    return spec.gpus_per_node // spec.tasks_per_node if spec.gpus_per_node else 0


def local_gpu_layout(plan: JobPlan, colocated: Dict[str, str] | None = None) -> None:
    """Give the components of a one-node (local) plan disjoint GPU ranges: each component's
    ``gpu_first`` follows the GPUs of those before it; a role in ``colocated`` (role -> host
    role) takes its host's first GPU instead (one GPU shared on purpose)."""
    colocated = colocated or {}
    first = 0
    for role, spec in plan.components.items():
        if not spec.gpus_per_node:
            continue
        if role in colocated:
            spec.gpu_first = plan.components[colocated[role]].gpu_first
            continue
        spec.gpu_first = first
        first += spec.gpus_per_node


def local_gpus(spec: ComponentSpec, rank: int, visible: List[str]) -> List[str]:
    """Task ``rank``'s GPUs on this node (``visible``: the node's device ids, in order)."""
    each = gpus_per_task(spec)
    start = spec.gpu_first + (rank - spec.first_rank) % spec.tasks_per_node * each
    if start + each > len(visible):
        raise LaunchError(f"task {rank} would use GPUs {start}..{start + each - 1} of this node, which "
                          f"has {len(visible)} ({','.join(visible) or 'none'})")
    return visible[start:start + each]


def slurm_gpus(spec: ComponentSpec, environ: Mapping[str, str]) -> List[str]:
    """This Slurm task's GPUs: what Slurm bound to it (module docstring)."""
    each = gpus_per_task(spec)
    bound = [g for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if len(bound) == each:  # Slurm bound this task's own GPUs (--gpus-per-task, --gpu-bind)
        return bound
    if len(bound) == spec.gpus_per_node:  # the node's GPUs, shared by the step's tasks on it
        local = int(environ.get("SLURM_LOCALID", "0"))
        return bound[local * each:(local + 1) * each]
    raise LaunchError(f"Slurm bound GPUs {bound or 'none'} to this task; its component asks for "
                      f"{spec.gpus_per_node} per node, {each} per task (is gres/gpu configured?)")


def task_gpu_env(plan: JobPlan, role: str, rank: int, environ: Mapping[str, str]) -> Dict[str, str]:
    """The environment that confines task (``role``, ``rank``) to its GPUs (module docstring)."""
    spec = plan.components[role]
    if not spec.gpus_per_node:
        return {"CUDA_VISIBLE_DEVICES": "", "LOCAL_RANK": "0"}
    if environ.get(LAUNCHER_ENV) == "slurm":
        gpus = slurm_gpus(spec, environ)
    else:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        ids = [g for g in visible.split(",") if g.strip()] if visible is not None else \
            [str(i) for i in range(node_gpu_count())]
        gpus = local_gpus(spec, rank, ids)
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus), "LOCAL_RANK": "0"}


COLOCATED_GPU_SHARE = 0.45
"""Most of a shared GPU's memory vLLM may take when the trainer runs on the same GPU."""


def resolve_local_gpus(cfg) -> None:
    """Spread a local run over this machine's GPUs (``cluster.gpus``, see its doc) when no
    component asks for GPUs itself; a Slurm run or explicit ``gpus_per_node`` are left alone.
    Fills ``cluster.gpus`` with the count found, so the run directory's config records it."""
    c, g = cfg.cluster, cfg.generator
    if c.gpus is None:
        c.gpus = node_gpu_count() if c.launcher == "local" else 0
    specs = (c.trainer, c.generator, c.scorer, c.teacher)
    if c.launcher != "local" or not c.gpus or any(s.gpus_per_node for s in specs):
        return
    generators = 0 if cfg.replay.source else c.generators
    if c.gpus >= c.trainer_ranks + generators * g.tensor_parallel_size:
        c.trainer.gpus_per_node = c.trainer_ranks
        c.generator.gpus_per_node = generators * g.tensor_parallel_size
    elif c.gpus == 1 and c.trainer_ranks == 1 and generators == 1 and g.tensor_parallel_size == 1:
        c.trainer.gpus_per_node = c.generator.gpus_per_node = 1
        g.weight_channel = "cuda_ipc"
        g.gpu_memory_utilization = min(g.gpu_memory_utilization, COLOCATED_GPU_SHARE)


def colocated_roles(cfg) -> Dict[str, str]:
    """role -> the role whose GPU it shares on purpose (a CUDA IPC weight channel needs one GPU)."""
    return {"generator": "trainer"} if cfg.generator.weight_channel == "cuda_ipc" else {}
