"""What every role process shares: the CPU core plan and rank agreement (the run's config and
model: `pipeline.run_dir`)."""
from __future__ import annotations

import os

from pipeline.config import TokenflowConfig


def cpu_cores_for(role: str, rank: int, cfg: TokenflowConfig) -> list[int] | None:
    """Cores a role's process is pinned to under ``cluster.cpu_plan=auto`` (None: no pinning).

    The plan gives generators the first cores and the trainer ranks the rest, one core each when
    there are enough; on a 2-core machine: generator on core 0, trainer (and the orchestrator
    beside it) on core 1. The same plan applies to synchronous and asynchronous runs. With fewer
    cores than generators and trainer ranks, and several generators, each generator gets one core,
    spread over all the cores in turn (generator ``i`` on core ``i mod cores``, the trainer ranks
    keeping the rest): one engine's spinning OpenMP threads starve another engine on the same core
    (a generator restarted beside the other one on core 0 of a 2-core machine got 2 s of CPU in
    2.5 min), so two engines share a core only when there are more generators than cores; on 2
    cores with 2 generators: generator 0 on core 0, generator 1 beside the trainer on core 1.
    Generators that joined from their own job (ranks from ``cluster.generators`` on) share trainer
    rank 0's cores, for the same reason, at a lower priority (`shares_trainer_cores`).
    """
    if cfg.cluster.cpu_plan != "auto" or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    n_gen, n_tr = cfg.cluster.generators, cfg.cluster.trainer_ranks
    if len(cores) < 2:
        return None
    if role == "generator" and rank >= n_gen:  # joined from its own job (`tokenflow generators`)
        role, rank = "trainer", 0  # the trainer's cores: a generation-bound trainer leaves them idle
    if len(cores) >= n_gen + n_tr:
        index = rank if role == "generator" else n_gen + rank
        return [cores[index]]
    half = max(1, len(cores) * n_gen // (n_gen + n_tr))
    if role == "generator" and n_gen > 1:  # fewer cores than generators and ranks: spread the engines
        return [cores[rank % len(cores)]]
    return cores[:half] if role == "generator" else cores[half:]


def shares_trainer_cores(rank: int, cfg: TokenflowConfig, cores: list[int] | None) -> bool:
    """True for a generator that joined from its own job and is placed (``cores``, its
    `cpu_cores_for`) on trainer rank 0's cores: it then yields them (`lower_cpu_priority`,
    ``cluster.joined_generator_nice``)."""
    return cores is not None and rank >= cfg.cluster.generators


def lower_cpu_priority(nice: int) -> None:
    """Make this process, its future children and the rest of its session ``nice`` nicer.

    Both the process's nice value and its Linux autogroup's: where the kernel groups each session
    for scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, the default on desktop and
    container kernels), a process's own nice value orders it only within its session, and a task
    started in a session of its own (every local task; `pipeline.launch.local`) competes with
    another session's as an equal whatever its nice value (measured on this machine: two spinning
    processes on one core, the other session at nice 10: 50/50; with its autogroup at nice 10:
    90/10; at 19: 98/2). Raising one's own niceness needs no privilege."""
    if nice <= 0:
        return
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroups (kernel option or switched off): the nice value is enough
        pass


def pin_process(cores: list[int] | None) -> None:
    """Pin this process (and the threads it starts) to ``cores``; one intra-op thread per core."""
    if not cores:
        return
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    try:
        import torch
        torch.set_num_threads(len(cores))
    except ImportError:
        pass


def agree_over_ranks(value: int, *, world: int, cuda: bool, op: str = "max") -> int:
    """The max (or, with op='leader', rank 0's value; with op='sum', the sum) of `value` over the
    trainer ranks: a collective every rank calls (a no-op with one rank)."""
    if world == 1:
        return value
    import torch
    import torch.distributed as td

    t = torch.tensor([value], dtype=torch.int64, device="cuda" if cuda else "cpu")
    if op == "leader":
        td.broadcast(t, src=0)
    else:
        td.all_reduce(t, op=td.ReduceOp.SUM if op == "sum" else td.ReduceOp.MAX)
    return int(t.item())
