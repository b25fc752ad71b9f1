"""Tasks: prompt sources with exact verifiers (see pipeline.tasks.base for the interface's invariants).

The built-in default is `sort` (pipeline.tasks.sorting): a tiny model warm-started for a minute solves
some prompts greedily and more when sampling, so RL has visible headroom. `addition` is harder (a tiny
model plateaus around 10 % greedy after supervised warm-start). `jsonl` reads users' prompt/answer data.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.tasks.addition import AdditionTask
from pipeline.tasks.base import Prompt, Task
from pipeline.tasks.jsonl import JsonlTask
from pipeline.tasks.sorting import SortDigitsTask


@dataclass
class TaskConfig:
    """Which task a run trains on."""

    name: str = "sort"  # "sort" (built-in), "addition" (built-in, harder) or "jsonl" (users' file)
    min_digits: int = 6  # sort: shortest digit string
    max_digits: int = 8  # sort: longest digit string
    digits: int = 2  # addition: operands have at most this many digits
    path: str | None = None  # jsonl: the prompt/answer file
    eval_path: str | None = None  # jsonl: optional separate held-out file (else a fixed split of `path`)
    eval_size: int = 200  # size of the held-out set (jsonl: at most a fifth of the rows)


def make_task(cfg: TaskConfig) -> Task:
    """The Task a TaskConfig describes."""
    if cfg.name == "sort":
        return SortDigitsTask(min_digits=cfg.min_digits, max_digits=cfg.max_digits, eval_size=cfg.eval_size)
    if cfg.name == "addition":
        return AdditionTask(digits=cfg.digits, eval_size=cfg.eval_size)
    if cfg.name == "jsonl":
        if not cfg.path:
            raise ValueError("task.name=jsonl needs task.path=<file.jsonl>")
        return JsonlTask(cfg.path, eval_path=cfg.eval_path, eval_size=cfg.eval_size)
    raise ValueError(f"unknown task {cfg.name!r} (known: sort, addition, jsonl)")


__all__ = ["AdditionTask", "JsonlTask", "Prompt", "SortDigitsTask", "Task", "TaskConfig", "make_task"]
