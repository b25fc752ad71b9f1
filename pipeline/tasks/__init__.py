"""Tasks: prompt sources with exact verifiers (see pipeline.tasks.base for the interface's invariants).

The built-in default is `sort` (pipeline.tasks.sorting): a tiny model warm-started for a minute solves
some prompts greedily and more when sampling, so RL has visible headroom. `addition` is harder (a tiny
model plateaus around 10 % greedy after supervised warm-start). `dataset` reads users' data: JSONL,
Parquet (verl's layout too), Arrow or `datasets` directories (pipeline.tasks.dataset, docs/data.md);
`jsonl` is another name for it. `toolcalc` (pipeline.tasks.toolcalc) is a multi-turn tool task: its episodes call
the calculator environment (`task_environment`; docs/episodes.md). How prompts become tokens: pipeline.tasks.prompting; what the orchestrator serves:
pipeline.tasks.sources.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.tasks.addition import AdditionTask
from pipeline.tasks.base import Prompt, Task
from pipeline.tasks.dataset import SPLIT_SEED, DatasetTask
from pipeline.tasks.sorting import SortDigitsTask
from pipeline.tasks.toolcalc import ToolCalcTask


@dataclass
class TaskConfig:
    """Which task a run trains on, and how its prompts are presented."""

    name: str = "sort"  # "sort" (built-in), "addition" (built-in, harder), "toolcalc" (built-in, tool episodes) or "dataset" (users' data; "jsonl" is the same)
    min_digits: int = 6  # sort: shortest digit string
    max_digits: int = 8  # sort: longest digit string
    digits: int = 2  # addition: operands have at most this many digits
    path: str | None = None  # dataset: a .jsonl/.json, .parquet or .arrow file or a `datasets.save_to_disk` directory
    split: str = "train"  # dataset: the split of a saved DatasetDict
    columns: dict[str, str] = field(default_factory=dict)  # dataset: {prompt, answer, data_source, extra_info} -> column (a.b: struct field); unset: verl's or prompt/answer
    eval_sets: dict[str, str] = field(default_factory=dict)  # dataset: held-out sets {name: path}, each reported on its own (empty: a fixed split of `path` named heldout)
    eval_size: int = 200  # size of the held-out set (dataset: at most eval_fraction of the rows)
    eval_fraction: float = 0.2  # dataset without eval_sets: largest share of the rows held out
    split_seed: int = SPLIT_SEED  # dataset without eval_sets: seed of the held-out draw
    shuffle: bool = True  # dataset: each epoch in a seeded order (orchestrator.seed); false: file order
    epochs: int | None = None  # dataset: passes over the training rows the run may use (None: no limit)
    verifier: str | None = None  # dataset: "math-verify" (None: the default), "simple", "module:function" or "/path/file.py:function" (pipeline.tasks.verifiers)
    reward_by_source: dict[str, str] = field(default_factory=dict)  # dataset: data_source -> verifier (as task.verifier) for its rows
    on_bad_row: str = "error"  # dataset: "error" (stop naming the row) or "skip" (leave it out, counted)
    max_tokens: int | None = None  # completion budget (None: the task's own; generator.max_tokens follows)
    max_prompt_tokens: int | None = None  # longest prompt in tokens (None: the task's own); longer ones fail
    prompt_format: str = "chat"  # "chat" (the tokenizer's chat template) or "raw" (the text as is)
    system_prompt: str | None = None  # chat: a system turn before every prompt
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat: e.g. {enable_thinking: false}


#: The names of the dataset task (`jsonl`: the name it had when it read JSONL only).
DATASET_NAMES = ("dataset", "jsonl")


def make_task(cfg: TaskConfig) -> Task:
    """The Task a TaskConfig describes."""
    if cfg.name == "sort":
        task: Task = SortDigitsTask(min_digits=cfg.min_digits, max_digits=cfg.max_digits, eval_size=cfg.eval_size)
    elif cfg.name == "addition":
        task = AdditionTask(digits=cfg.digits, eval_size=cfg.eval_size)
    elif cfg.name == "toolcalc":
        task = ToolCalcTask(eval_size=cfg.eval_size)
    elif cfg.name in DATASET_NAMES:
        if not cfg.path:
            raise ValueError(f"task.name={cfg.name} needs task.path=<a .jsonl, .parquet or .arrow file or a "
                             "datasets directory>")
        task = DatasetTask(cfg.path, columns=dict(cfg.columns), eval_sets=dict(cfg.eval_sets),
                           eval_size=cfg.eval_size, eval_fraction=cfg.eval_fraction, split_seed=cfg.split_seed,
                           shuffle=cfg.shuffle, verifier=cfg.verifier, reward_by_source=dict(cfg.reward_by_source),
                           on_bad_row=cfg.on_bad_row, split=cfg.split)
    else:
        raise ValueError(f"unknown task {cfg.name!r} (known: sort, addition, toolcalc, dataset)")
    if cfg.name not in DATASET_NAMES and (cfg.verifier or cfg.epochs is not None or cfg.reward_by_source):
        raise ValueError(f"task.verifier, task.reward_by_source and task.epochs apply to task=dataset only "
                         f"(task.name={cfg.name!r})")
    if cfg.max_tokens is not None:
        task.max_tokens = cfg.max_tokens
    if cfg.max_prompt_tokens is not None:
        task.max_prompt_tokens = cfg.max_prompt_tokens
    return task


def task_environment(cfg: TaskConfig, environment: str = "") -> str | None:
    """The environment a task's episodes run in (`pipeline.envs`): ``environment`` (the run's
    ``episode.environment``) if set, else the task's own; None for single-turn tasks."""
    return environment or (ToolCalcTask.environment if cfg.name == ToolCalcTask.name else None)


__all__ = ["AdditionTask", "DatasetTask", "Prompt", "SortDigitsTask", "Task", "TaskConfig", "ToolCalcTask", "make_task",
           "task_environment"]
