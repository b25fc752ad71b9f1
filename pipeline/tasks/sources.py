"""What the orchestrator serves from a task: tokenized training and held-out prompts and a verifier.

Invariants:
- Group g's prompt is the task's training prompt at position g of the run seed's stream
  (pipeline.tasks.base): a pure function of (task config, seed, g), so a re-issued or resumed group gets
  exactly the prompt it had, and nothing is capped: a dataset is walked epoch after epoch, a generated
  task draws a fresh prompt per group.
- The recorded prompt id is the task's prompt id (dataset: the training row's index; generated: the
  position); each prompt is tokenized once per process (the PromptSource cache) with the run's
  PromptFormat (pipeline.tasks.prompting).
- The verifier decodes completion ids without special tokens and calls `task.score`.
- A dataset task's prompts longer than `task.max_prompt_tokens` (chat template included) are left out
  before the first group is served (`DatasetTask.drop_training_rows`), so group g's prompt is still a
  pure function of (config, tokenizer, seed, g); `counts` says how many (``too_long_train``,
  ``too_long_eval``) beside the task's ``bad_rows``. This tokenizes every row once at the start
  (about 10 s per 100,000 short prompts on one core). A generated task's prompts never exceed it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Callable

import numpy as np

from pipeline.orchestrator.prompts import PromptItem, PromptSource, TextPromptSource
from pipeline.tasks import TaskConfig, make_task
from pipeline.tasks.base import Task
from pipeline.tasks.dataset import DatasetTask
from pipeline.tasks.prompting import PromptFormat


class TaskPromptSource(PromptSource):
    """A task's training stream as the orchestrator's prompt source."""

    def __init__(self, task: Task, encode: Callable, seed: int):
        super().__init__(seed)
        self.task, self.encode = task, encode

    def __len__(self) -> int:
        if self.task.train_size is None:
            raise TypeError(f"task {self.task.name!r} generates prompts: its training stream has no length")
        return self.task.train_size

    def prompt_id_for_group(self, group_id: int) -> int:
        return self.task.prompt_id(self.seed, group_id)

    def load(self, prompt_id: int) -> PromptItem:
        prompt = self.task.prompt_by_id(self.seed, prompt_id)
        return PromptItem(prompt_id, np.asarray(self.encode(prompt), dtype=np.int32), prompt)


def _drop_long_prompts(task: DatasetTask, fmt: PromptFormat, tokenizer, seed: int) -> Counter:
    unlimited = replace(fmt, max_prompt_tokens=None)
    limit = fmt.max_prompt_tokens

    def too_long(prompt) -> bool:
        return limit is not None and len(unlimited.encode(tokenizer, task, prompt)) > limit

    long_train = [i for i in range(task.train_size) if too_long(task.prompt_by_id(seed, i))]
    long_eval = {p.uid for p in task.eval_prompts() if too_long(p)}
    if long_train:
        task.drop_training_rows(long_train)
    task.drop_eval_prompts(long_eval)
    return Counter(task.counts, too_long_train=len(long_train), too_long_eval=len(long_eval))


def task_prompt_sources(task_cfg: TaskConfig, tokenizer, seed: int):
    """(training source, held-out source, verify(item, completion_ids) -> reward, counts) of a task;
    counts: the dataset rows left out (see the module invariants), empty for a generated task."""
    task = make_task(task_cfg)
    fmt = PromptFormat.of(task_cfg, task)
    counts = _drop_long_prompts(task, fmt, tokenizer, seed) if isinstance(task, DatasetTask) else Counter()

    def encode(prompt) -> list[int]:
        return fmt.encode(tokenizer, task, prompt)

    def verify(item: PromptItem, completion_ids: np.ndarray) -> float:
        return float(task.score(item.answer, tokenizer.decode(completion_ids, skip_special_tokens=True)))

    evals = TextPromptSource([(p, p) for p in task.eval_prompts()], encode, seed)
    return TaskPromptSource(task, encode, seed), evals, verify, counts
