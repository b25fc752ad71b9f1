"""The task interface: where prompts come from and how a completion is scored.

Invariants every task keeps:
- The training stream of a seed is random-access: position i of seed s holds prompt
  `prompt_by_id(s, prompt_id(s, i))`, a pure function of (s, i) in any process, on any machine; so a
  resumed or re-issued group gets exactly the prompt it had. `train_prompts(seed)` walks it from 0.
  Generated tasks draw a fresh prompt per position (prompt id = position); dataset tasks map positions
  to row ids (epochs, shuffling: pipeline.tasks.dataset).
- `eval_prompts()` is fixed (it does not depend on any seed the caller passes) and no eval prompt's text
  ever appears in a training stream.
- `score(prompt, completion_text)` is a pure function returning a reward in [0, 1].
- `messages(prompt)` is the prompt's user turn; pipeline.tasks.prompting adds the system prompt and
  renders it (chat template or raw text); the orchestrator tokenizes once (`docs/architecture.md`, "Contracts").
- `reference_completion(prompt)` is the completion a perfect policy would write (used by the supervised
  warm-start); `score(prompt, reference_completion(prompt)) == 1.0`.
- `distractor_completion(prompt)` is None or a plausible wrong completion (score 0.0) that a noisy
  warm-start mixes into its demonstrations (pipeline.models.warmstart).
"""
from __future__ import annotations

import abc
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

# The end-of-turn marker of the chat template; a generator may or may not decode it into the text.
END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class Prompt:
    """One task prompt.

    uid: stable identifier, unique within the task (e.g. "add:37+48" or "data.parquet:12").
    text: the user message.
    answer: the reference answer the verifier compares against.
    messages: a dataset's chat-list prompt as (role, content) turns (None: one user turn of `text`).
    data_source: the dataset row's source (picks its verifier; metrics by source); "" if none.
    extra_info: the dataset row's extra_info as JSON (passed to verl-style reward functions), or None.
    eval_set: the held-out set the prompt belongs to ("" for a training prompt).
    """

    uid: str
    text: str
    answer: str
    messages: tuple[tuple[str, str], ...] | None = None
    data_source: str = ""
    extra_info: str | None = None
    eval_set: str = ""


def strip_completion(completion_text: str) -> str:
    """The completion without surrounding whitespace and without a trailing end-of-turn marker."""
    text = completion_text.strip()
    if text.endswith(END_OF_TURN):
        text = text[: -len(END_OF_TURN)].rstrip()
    return text


class Task(abc.ABC):
    """A source of prompts plus an exact verifier (see the module docstring for the invariants)."""

    name: str
    max_tokens: int = 1024
    """Completion budget the task's answers need (generator.max_tokens follows it unless set)."""
    max_prompt_tokens: int = 1024
    """Longest prompt in tokens (with the chat template); with max_tokens it sizes max_model_len."""
    train_size: int | None = None
    """Distinct training prompts of a dataset task; None for a generated task (endless fresh draws)."""
    warmstart_distractor_fraction: float = 0.5
    """Share of the warm-start's demonstrations replaced by `distractor_completion` (pipeline.models.warmstart)."""
    warmstart_steps: int = 120
    """Warm-start steps of the built-in tiny models on this task (model.warmstart_steps left None)."""

    def prompt_id(self, seed: int, position: int) -> int:
        """Id of the prompt at `position` of seed `seed`'s training stream (generated: the position)."""
        return position

    @abc.abstractmethod
    def prompt_by_id(self, seed: int, prompt_id: int) -> Prompt:
        """The training prompt with this id (never an eval prompt)."""

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """Endless deterministic stream of training prompts: positions 0, 1, 2, ... of `seed`."""
        return (self.prompt_by_id(seed, self.prompt_id(seed, i)) for i in itertools.count())

    @abc.abstractmethod
    def eval_prompts(self) -> list[Prompt]:
        """The fixed held-out set used for greedy evaluation."""

    @abc.abstractmethod
    def score(self, prompt: Prompt, completion_text: str) -> float:
        """Reward of `completion_text` for `prompt`, in [0, 1]."""

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """Chat messages for `prompt` (one user turn)."""
        return [{"role": "user", "content": prompt.text}]

    def reference_completion(self, prompt: Prompt) -> str:
        """What a perfect policy answers (before the end-of-turn token)."""
        return prompt.answer

    def distractor_completion(self, prompt: Prompt) -> str | None:
        """A plausible but wrong completion for noisy demonstrations, or None when the task has none."""
        return None
