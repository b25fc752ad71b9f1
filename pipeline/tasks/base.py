"""The task interface: where prompts come from and how a completion is scored.

Invariants every task keeps:
- `train_prompts(seed)` is an endless, deterministic stream: the same seed yields the same prompts in the
  same order, in any process, on any machine.
- `eval_prompts()` is fixed (it does not depend on any seed the caller passes) and no eval prompt's text
  ever appears in a training stream.
- `score(prompt, completion_text)` is a pure function returning a reward in [0, 1].
- `messages(prompt)` turns a prompt into chat messages for the tokenizer's chat template; the
  orchestrator tokenizes once (`docs/architecture.md`, "Contracts").
- `reference_completion(prompt)` is the completion a perfect policy would write (used by the supervised
  warm-start); `score(prompt, reference_completion(prompt)) == 1.0`.
- `distractor_completion(prompt)` is None or a plausible wrong completion (score 0.0) that a noisy
  warm-start mixes into its demonstrations (pipeline.models.warmstart).
"""
from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass

# The end-of-turn marker of the chat template; a generator may or may not decode it into the text.
END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class Prompt:
    """One task prompt.

    uid: stable identifier, unique within the task (e.g. "add:37+48" or "file.jsonl:12").
    text: the user message.
    answer: the reference answer the verifier compares against.
    """

    uid: str
    text: str
    answer: str


def strip_completion(completion_text: str) -> str:
    """The completion without surrounding whitespace and without a trailing end-of-turn marker."""
    text = completion_text.strip()
    if text.endswith(END_OF_TURN):
        text = text[: -len(END_OF_TURN)].rstrip()
    return text


class Task(abc.ABC):
    """A source of prompts plus an exact verifier (see the module docstring for the invariants)."""

    name: str

    @abc.abstractmethod
    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """Endless deterministic stream of training prompts (never an eval prompt)."""

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
