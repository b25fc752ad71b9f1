"""The built-in synthetic task: sort a string of digits in ascending order.

Worked example: the prompt text is "sort 9314185", the reference answer "1134589"; a completion scores
1.0 when, after stripping whitespace and a trailing "<|im_end|>", it is exactly "1134589" ("1 1 3 4 5 8 9",
"134589", "11345890" score 0.0). Defaults: 6 to 8 digits.

Invariants:
- A prompt's digit string has a length in [min_digits, max_digits], each length equally likely, digits
  uniform: 10**6 + 10**7 + 10**8 possible strings by default.
- The held-out set is `eval_size` distinct strings drawn with a fixed seed (EVAL_SEED) that no caller can
  change; training streams skip every held-out string, so train and eval never share a prompt.
- Training prompt i of seed s is drawn with `random.Random(f"sort:{s}:{i}")` (re-drawn while it is held
  out): random access, reproducible anywhere.
"""
from __future__ import annotations

import random

from pipeline.tasks.base import Prompt, Task, strip_completion

# Seed of the held-out draw: part of the task's definition, not a run setting.
EVAL_SEED = 20_240_301


class SortDigitsTask(Task):
    """`sort <digits>` -> the digits in ascending order; exact-match verifier."""

    name = "sort"
    max_tokens = 32
    max_prompt_tokens = 32  # "sort " + at most 8 digits + the chat template
    warmstart_distractor_fraction = 0.65  # greedy prefers the wrong order at first (pipeline.models.warmstart)
    warmstart_steps = 300  # long enough to sort well in either order (the module docstring)

    def __init__(self, min_digits: int = 6, max_digits: int = 8, eval_size: int = 200):
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"SortDigitsTask: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        space = sum(10**n for n in range(min_digits, max_digits + 1))
        if not 0 < eval_size <= space // 10:
            raise ValueError(f"SortDigitsTask: eval_size must be in 1..{space // 10} for these lengths, got {eval_size}")
        self.min_digits, self.max_digits, self.eval_size = min_digits, max_digits, eval_size
        rng = random.Random(EVAL_SEED)
        held: dict[str, None] = {}  # insertion-ordered set
        while len(held) < eval_size:
            held[self._draw(rng)] = None
        self._eval = list(held)
        self._eval_set = frozenset(held)

    def _draw(self, rng: random.Random) -> str:
        n = rng.randint(self.min_digits, self.max_digits)
        return "".join(str(rng.randrange(10)) for _ in range(n))

    @staticmethod
    def _prompt(digits: str) -> Prompt:
        return Prompt(uid=f"sort:{digits}", text=f"sort {digits}", answer="".join(sorted(digits)))

    def prompt_by_id(self, seed: int, prompt_id: int) -> Prompt:
        rng = random.Random(f"sort:{seed}:{prompt_id}")
        while True:
            digits = self._draw(rng)
            if digits not in self._eval_set:
                return self._prompt(digits)

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(d) for d in self._eval]

    def distractor_completion(self, prompt: Prompt) -> str | None:
        """The digits in descending order (wrong unless all digits are equal)."""
        wrong = prompt.answer[::-1]
        return wrong if wrong != prompt.answer else None

    def score(self, prompt: Prompt, completion_text: str) -> float:
        return 1.0 if strip_completion(completion_text) == prompt.answer else 0.0
