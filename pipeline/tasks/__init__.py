"""Tasks: prompt sources with exact verifiers (see pipeline.tasks.base for the interface's invariants).

The built-in default is `sort` (pipeline.tasks.sorting): a tiny model warm-started for a minute solves
some prompts greedily and more when sampling, so RL has visible headroom. `addition` is harder (a tiny
model plateaus around 10 % greedy after supervised warm-start). `jsonl` reads users' prompt/answer data
(docs/data.md). `toolcalc` (pipeline.tasks.toolcalc) is a multi-turn tool task: its episodes call
the calculator environment (`task_environment`; docs/episodes.md). How prompts become tokens: pipeline.tasks.prompting; what the orchestrator serves:
pipeline.tasks.sources.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.tasks.addition import AdditionTask
from pipeline.tasks.base import Prompt, Task
from pipeline.tasks.jsonl import SPLIT_SEED, JsonlTask
from pipeline.tasks.sorting import SortDigitsTask
from pipeline.tasks.toolcalc import ToolCalcTask


@dataclass
class TaskConfig:
    """Which task a run trains on, and how its prompts are presented."""

    name: str = "sort"  # "sort" (built-in), "addition" (built-in, harder), "toolcalc" (built-in, tool episodes) or "jsonl" (users' file)
    min_digits: int = 6  # sort: shortest digit string
    max_digits: int = 8  # sort: longest digit string
    digits: int = 2  # addition: operands have at most this many digits
    path: str | None = None  # jsonl: the prompt/answer file (docs/data.md)
    eval_path: str | None = None  # jsonl: optional separate held-out file (else a fixed split of `path`)
    eval_size: int = 200  # size of the held-out set (jsonl: at most eval_fraction of the rows)
    eval_fraction: float = 0.2  # jsonl without eval_path: largest share of the rows held out
    split_seed: int = SPLIT_SEED  # jsonl without eval_path: seed of the held-out draw
    shuffle: bool = True  # jsonl: each epoch in a seeded order (orchestrator.seed); false: file order
    epochs: int | None = None  # jsonl: passes over the training rows the run may use (None: no limit)
    verifier: str | None = None  # jsonl: "module:function" scoring (completion, answer, prompt) -> [0, 1]
    max_tokens: int | None = None  # completion budget (None: the task's own; generator.max_tokens follows)
    max_prompt_tokens: int | None = None  # longest prompt in tokens (None: the task's own); longer ones fail
    prompt_format: str = "chat"  # "chat" (the tokenizer's chat template) or "raw" (the text as is)
    system_prompt: str | None = None  # chat: a system turn before every prompt
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat: e.g. {enable_thinking: false}


def make_task(cfg: TaskConfig) -> Task:
    """The Task a TaskConfig describes."""
    if cfg.name == "sort":
        task: Task = SortDigitsTask(min_digits=cfg.min_digits, max_digits=cfg.max_digits, eval_size=cfg.eval_size)
    elif cfg.name == "addition":
        task = AdditionTask(digits=cfg.digits, eval_size=cfg.eval_size)
    elif cfg.name == "toolcalc":
        task = ToolCalcTask(eval_size=cfg.eval_size)
    elif cfg.name == "jsonl":
        if not cfg.path:
            raise ValueError("task.name=jsonl needs task.path=<file.jsonl>")
        task = JsonlTask(cfg.path, eval_path=cfg.eval_path, eval_size=cfg.eval_size,
                         eval_fraction=cfg.eval_fraction, split_seed=cfg.split_seed, shuffle=cfg.shuffle,
                         verifier=cfg.verifier)
    else:
        raise ValueError(f"unknown task {cfg.name!r} (known: sort, addition, toolcalc, jsonl)")
    if cfg.name != "jsonl" and (cfg.verifier or cfg.epochs is not None):
        raise ValueError(f"task.verifier and task.epochs apply to task=jsonl only (task.name={cfg.name!r})")
    if cfg.max_tokens is not None:
        task.max_tokens = cfg.max_tokens
    if cfg.max_prompt_tokens is not None:
        task.max_prompt_tokens = cfg.max_prompt_tokens
    return task


def task_environment(cfg: TaskConfig, environment: str = "") -> str | None:
    """The environment a task's episodes run in (`pipeline.envs`): ``environment`` (the run's
    ``episode.environment``) if set, else the task's own; None for single-turn tasks."""
    return environment or (ToolCalcTask.environment if cfg.name == ToolCalcTask.name else None)


__all__ = ["AdditionTask", "JsonlTask", "Prompt", "SortDigitsTask", "Task", "TaskConfig", "ToolCalcTask", "make_task",
           "task_environment"]
