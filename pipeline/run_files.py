"""The names inside a run directory (``runs/<run.name>/``), in one place.

Every module that reads or writes a run's files takes the name from here; nothing else spells
them. See `docs/architecture.md`, "Launching" for what each holds.

Worked example: for ``runs/exp1``, the rollout log is ``runs/exp1/rollouts/segment-00000.h5``,
the checkpoint after 8 steps ``runs/exp1/checkpoints/step-8/``, trainer rank 0's output
``runs/exp1/logs/trainer.0.out``.
"""
from __future__ import annotations

CONFIG_FILE = "config.yaml"
"""The resolved run configuration (what a resume must agree with)."""
MODEL_FILE = "model.json"
"""Where the run's prepared (warm-started) model lives."""
ROLLOUTS_DIR = "rollouts"
"""The rollout log: one HDF5 segment per orchestrator start."""
CHECKPOINTS_DIR = "checkpoints"
"""Trainer checkpoints, ``step-K/`` each."""
METRICS_DIR = "metrics"
"""One JSONL file per writer process, ``<role>-<host>-<pid>.jsonl`` (pipeline.metrics)."""
LEGACY_METRICS_FILE = "metrics.jsonl"
"""The single metrics file of a run directory written before `METRICS_DIR` (still read)."""
SECRET_FILE = "secret"
"""The run's message-authentication key (mode 0600)."""
LOGS_DIR = "logs"
"""``<role>.<rank>.out`` per task (appended per attempt), ``orchestrator.out``."""
RESULTS_DIR = "results"
"""``<role>.<rank>.json`` per task: its return value or error."""
PLAN_FILE = "launch/plan.json"
"""The job plan of the latest launch."""
LAUNCHES_FILE = "launch/launches.jsonl"
"""One line per launch (launcher, time, Slurm job id or local pids)."""
GENERATOR_JOBS_FILE = "launch/generator-jobs.jsonl"
"""One line per generator job that joined the run (`tokenflow generators`): its generator ranks,
launcher, Slurm job id or local pids; ``generator-jobs.lock`` beside it serialises rank allocation."""
GENERATOR_JOB_PLAN = "launch/generators-{index}.json"
"""The job plan of generator job ``index`` (its tasks read it instead of `PLAN_FILE`)."""
RENDEZVOUS_DIR = "rendezvous"
"""Addresses processes publish for each other (``attempt-<n>/<key>.json``)."""
ORCHESTRATOR_RENDEZVOUS = "rendezvous/orchestrator.json"
"""The orchestrator's current address and incarnation."""
TENSORBOARD_DIR = "tensorboard"
"""The TensorBoard mirror of the metrics."""
EVAL_ANSWERS_FILE = "eval/answers.jsonl"
"""One line per held-out prompt per evaluation round: its rewards and completion ids
(pipeline.orchestrator.evaluation)."""
TRACKERS_DIR = "trackers"
"""The experiment trackers' local files: ``wandb/`` (offline runs), ``mlflow/`` (the file store)."""
PLOT_FILE = "training.png"
"""The end-of-run plot."""
SUBMITIT_DIR = "submitit"
"""submitit's own files (Slurm launches)."""
EXPORT_DIR = "export"
"""Hugging Face exports of the policy, one directory per checkpoint name (`tokenflow export`)."""


def checkpoint_name(steps_done: int) -> str:
    """The checkpoint directory name after ``steps_done`` optimizer steps."""
    return f"step-{steps_done}"
