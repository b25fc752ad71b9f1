"""The job plan: which components (roles) a run has and what each one needs.

A `JobPlan` is an ordered mapping of component name -> `ComponentSpec`. The order matters: on
Slurm, component k of the plan is component k of ONE heterogeneous job, and `SLURM_PROCID`
numbers the tasks component after component.

Invariants kept here (checked by `JobPlan.validate`, before anything is started):
- component names are roles: lower-case identifiers (`[a-z][a-z0-9_]*`), unique, at least one;
- every count is positive (GPUs may be 0), `mem_gb > 0`, `time_min > 0`;
- `entry` is "package.module:function"; the function is called once per task as
  `function(task)` with a `pipeline.launch.task.TaskInfo` (role, rank in role, run dir, attempt, ...).

Worked example: components trainer (nodes=2, tasks_per_node=1) then generator (nodes=1,
tasks_per_node=2) give 4 tasks; SLURM_PROCID 0,1 are trainer ranks 0,1 and SLURM_PROCID 2,3 are
generator ranks 0,1 (`JobPlan.task_layout()` returns exactly this list). A generator job that joins a
running run (`pipeline.launch.generator_jobs`) has one component, generator (first_rank=2,
tasks_per_node=2): its SLURM_PROCID 0,1 are generator ranks 2,3.

Plans are JSON-serialisable (`to_json` / `from_json`): the launcher stores the plan it ran as
`RUN/launch/plan.json`, and the local launcher's tasks read it from there.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

_ROLE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_SBATCH_OPTION = re.compile(r"-[A-Za-z]|--[A-Za-z][A-Za-z0-9-]*(=[^\x00-\x1f\x7f]*)?|-[A-Za-z][^\x00-\x1f\x7f]*")
"""One sbatch option: ``-x``, ``-xVALUE``, ``--name`` or ``--name=value``, no control characters."""
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class LaunchError(RuntimeError):
    """A run cannot be launched (bad plan, resources the cluster cannot give, sbatch refusal)."""


@dataclass
class ComponentSpec:
    """Resources and entry point of one component (one role) of a run."""

    entry: str = ""  # "package.module:function" called as function(task: TaskInfo) in every task
    nodes: int = 1  # nodes of this component
    tasks_per_node: int = 1  # processes per node (ranks of the role = nodes * tasks_per_node)
    cpus_per_task: int = 1  # CPUs reserved per process
    gpus_per_node: int = 0  # GPUs per node (Slurm --gpus-per-node); 0 asks for none
    mem_gb: float = 1.0  # memory per node in GiB (Slurm --mem)
    partition: Optional[str] = None  # Slurm partition; None = the cluster's default partition
    account: Optional[str] = None  # Slurm account to charge; None = the user's default
    time_min: int = 60  # wall-clock limit in minutes (Slurm --time)
    extra_sbatch: List[str] = field(default_factory=list)  # raw sbatch options for this component, e.g. "--constraint=h100"
    max_restarts: int = 0  # times a task's supervisor restarts its role process in place after it died
    optional: bool = False  # past max_restarts the task abandons (exit 0) and the run goes on without it
    first_rank: int = 0  # rank of this component's first task (a generator job joining a running run numbers its generators after those already there)
    gpu_first: int = 0  # node-local index of this component's first GPU in a local run (set by pipeline.launch.gpus.local_gpu_layout; Slurm binds GPUs itself)

    @property
    def num_tasks(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass
class JobPlan:
    """Every component of a run, in heterogeneous-job order, plus what all tasks share."""

    name: str = "tokenflow"  # Slurm job name
    components: Dict[str, ComponentSpec] = field(default_factory=dict)  # role -> resources, in launch order
    env: Dict[str, str] = field(default_factory=dict)  # environment variables set in every task
    config: Dict[str, Any] = field(default_factory=dict)  # JSON-able payload every task receives as task.config
    mpi: Optional[str] = None  # srun --mpi plugin (e.g. "pmix") so that mpi4py works in the tasks; None = no MPI
    max_requeues: int = 3  # how many times a timed-out/preempted job is requeued (submitit max_num_timeout)
    signal_delay_s: int = 90  # seconds before the time limit at which Slurm sends the checkpoint signal
    stop_grace_s: float = 60.0  # after the checkpoint signal, seconds rank 0 waits for its role to return, then requeues

    def validate(self) -> None:
        """Raise LaunchError naming every problem of the plan itself (no cluster needed)."""
        problems = []
        if not self.components:
            problems.append("the plan has no components")
        for role, spec in self.components.items():
            if not _ROLE_NAME.match(role):
                problems.append(f"component name {role!r} is not a role name ([a-z][a-z0-9_]*)")
            if not _ENTRY.match(spec.entry or ""):
                problems.append(f"{role}: entry {spec.entry!r} is not 'package.module:function'")
            for name in ("nodes", "tasks_per_node", "cpus_per_task", "time_min"):
                value = getattr(spec, name)
                if not isinstance(value, int) or value < 1:
                    problems.append(f"{role}: {name}={value!r} must be an integer >= 1")
            if not isinstance(spec.gpus_per_node, int) or spec.gpus_per_node < 0:
                problems.append(f"{role}: gpus_per_node={spec.gpus_per_node!r} must be an integer >= 0")
            elif isinstance(spec.tasks_per_node, int) and spec.tasks_per_node >= 1 and \
                    spec.gpus_per_node % spec.tasks_per_node:
                problems.append(f"{role}: gpus_per_node={spec.gpus_per_node} is not a multiple of "
                                f"tasks_per_node={spec.tasks_per_node} (each task gets an equal share)")
            if not isinstance(spec.max_restarts, int) or spec.max_restarts < 0:
                problems.append(f"{role}: max_restarts={spec.max_restarts!r} must be an integer >= 0")
            if not isinstance(spec.first_rank, int) or spec.first_rank < 0:
                problems.append(f"{role}: first_rank={spec.first_rank!r} must be an integer >= 0")
            if not spec.mem_gb > 0:
                problems.append(f"{role}: mem_gb={spec.mem_gb!r} must be > 0")
            for line in spec.extra_sbatch:
                if not _SBATCH_OPTION.fullmatch(line):
                    problems.append(f"{role}: extra sbatch option {line!r} must be one option ('-x', "
                                    f"'--name' or '--name=value') without control characters: it "
                                    f"becomes an #SBATCH line of the job script, and a newline "
                                    f"would start a shell command")
        for name in self.env:
            if not _ENV_NAME.fullmatch(name):
                problems.append(f"env {name!r} is not a variable name (it is exported by the job script)")
        if not 0 <= self.stop_grace_s < self.signal_delay_s:
            problems.append(f"stop_grace_s={self.stop_grace_s} must be >= 0 and below "
                            f"signal_delay_s={self.signal_delay_s}")
        if self.max_requeues < 0:
            problems.append(f"max_requeues={self.max_requeues} must be >= 0")
        if problems:
            raise LaunchError("invalid job plan: " + "; ".join(problems))

    def task_layout(self) -> List[Tuple[str, int]]:
        """(role, rank in role) of every task, indexed by global rank (SLURM_PROCID order); ranks of a
        component start at its ``first_rank``."""
        return [(role, spec.first_rank + i) for role, spec in self.components.items() for i in range(spec.num_tasks)]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> "JobPlan":
        raw = json.loads(text)
        components = {role: ComponentSpec(**spec) for role, spec in raw.pop("components").items()}
        return cls(components=components, **raw)


def scorer_components(cfg) -> Dict[str, ComponentSpec]:
    """The plan components of a run's scorer roles (`pipeline.scorers`), after trainer and
    generators: ``scorer`` (reward model / process rewards, ``scorers.reward_scorers`` tasks) and
    ``teacher`` (``scorers.teachers`` tasks), each only when the run uses it. Locally every task
    is a process on this node; on Slurm ``cluster.scorer`` / ``cluster.teacher`` give the
    nodes and tasks per node, which must multiply to the count."""
    s, c = cfg.scorers, cfg.cluster
    if cfg.replay.source:
        return {}
    wanted = {"scorer": (s.reward != "verifier", s.reward_scorers, c.scorer),
              "teacher": (s.teacher != "none", s.teachers, c.teacher)}
    out: Dict[str, ComponentSpec] = {}
    for role, (used, count, spec) in wanted.items():
        if not used:
            continue
        if c.launcher == "local":
            spec = dataclasses.replace(spec, nodes=1, tasks_per_node=count)
        if spec.num_tasks != count:
            raise ValueError(f"cluster.{role}: nodes x tasks_per_node = {spec.num_tasks} must equal "
                             f"the {role} count ({count})")
        out[role] = spec
    return out
