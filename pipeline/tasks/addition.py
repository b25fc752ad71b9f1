"""The built-in synthetic task: add two numbers of at most `digits` digits, answer with the exact sum.

Worked example (digits=2): the prompt text is "37+48=", the reference answer "85"; a completion scores
1.0 when, after stripping whitespace and a trailing "<|im_end|>", it is exactly "85" ("085", "85.",
"eighty-five" score 0.0).

Invariants:
- The operand space has (10**digits)**2 ordered pairs (10 000 for digits=2).
- The held-out set is `eval_size` distinct pairs drawn with a fixed seed (EVAL_SEED) that no caller can
  change; training streams skip every held-out pair, so train and eval never share a prompt.
- Training prompt i of seed s is a pair drawn uniformly with `random.Random(f"addition:{s}:{i}")`
  (re-drawn while it is held out): random access, reproducible anywhere.
"""
from __future__ import annotations

import random

from pipeline.tasks.base import Prompt, Task, strip_completion

# Seed of the held-out draw: part of the task's definition, not a run setting.
EVAL_SEED = 20_240_229


class AdditionTask(Task):
    """`a+b=` with 0 <= a, b < 10**digits; exact-match verifier."""

    name = "addition"
    max_tokens = 32
    max_prompt_tokens = 32

    def __init__(self, digits: int = 2, eval_size: int = 200):
        if digits < 1:
            raise ValueError(f"AdditionTask: digits must be >= 1, got {digits}")
        n_pairs = (10**digits) ** 2
        if not 0 < eval_size <= n_pairs // 2:
            raise ValueError(
                f"AdditionTask: eval_size must be in 1..{n_pairs // 2} for digits={digits}, got {eval_size}"
            )
        self.digits = digits
        self.eval_size = eval_size
        self._limit = 10**digits
        eval_rng = random.Random(EVAL_SEED)
        self._eval_pairs = eval_rng.sample(
            [(a, b) for a in range(self._limit) for b in range(self._limit)], eval_size
        )
        self._eval_set = frozenset(self._eval_pairs)

    @staticmethod
    def _prompt(a: int, b: int) -> Prompt:
        return Prompt(uid=f"add:{a}+{b}", text=f"{a}+{b}=", answer=str(a + b))

    def prompt_by_id(self, seed: int, prompt_id: int) -> Prompt:
        rng = random.Random(f"addition:{seed}:{prompt_id}")
        while True:
            pair = (rng.randrange(self._limit), rng.randrange(self._limit))
            if pair not in self._eval_set:
                return self._prompt(*pair)

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(a, b) for a, b in self._eval_pairs]

    def score(self, prompt: Prompt, completion_text: str) -> float:
        return 1.0 if strip_completion(completion_text) == prompt.answer else 0.0
