"""The built-in tool task: multiply two 2-digit numbers, which a tiny model cannot do alone but can
with the calculator tool (`pipeline.envs.calculator`): an episode of two model turns.

Worked example: the prompt text is "37*48="; the reference episode is the model turn "calc 37*48",
the tool turn "=1776" (written by the environment, not the model), then the model turn "1776". The
verifier reads the episode's transcript as decoded without special tokens,
"calc 37*48\\ntool\\n=1776\\nassistant\\n1776", and scores 1.0 when its last line is exactly "1776"
(a direct answer "1776" scores 1.0 too; "calc 37*48" alone, "=1776", "guess 85" or "1775" score 0.0).

Invariants:
- operands are in [10, 99]: 8100 ordered pairs; the held-out set is `eval_size` distinct pairs drawn
  with a fixed seed (EVAL_SEED), training streams skip them (train and eval never share a prompt);
- training prompt i of seed s is drawn with `random.Random(f"toolcalc:{s}:{i}")`: random access;
- `reference_completion` is the whole episode's text (the warm-start's demonstration of the tool
  format, observation included); `distractor_completion` guesses at once without the tool, with
  the sum instead of the product ("guess 85" for "37*48=": always wrong, a + b != a * b for
  a, b >= 10, and its last line is not a bare number). The warm-start shows the guess in 65 % of
  its demonstrations, so the warm-started policy mostly guesses when greedy (held-out accuracy
  near 0) but calls the tool in about a third of its samples: RL has to learn from the verifier
  alone that the tool earns reward.
"""
from __future__ import annotations

import random

from pipeline.envs.calculator import tool_turn
from pipeline.tasks.base import END_OF_TURN, Prompt, Task, strip_completion

# Seed of the held-out draw: part of the task's definition, not a run setting.
EVAL_SEED = 20_240_317
LOW, HIGH = 10, 99


class ToolCalcTask(Task):
    """`a*b=` with 10 <= a, b <= 99; the model may call `calc`; the last line must be the product."""

    name = "toolcalc"
    environment = "calculator"
    max_tokens = 40  # a call (~7 tokens), the tool turn (~12) and the answer (~5), with room to spare
    max_prompt_tokens = 32
    warmstart_distractor_fraction = 0.65

    def __init__(self, eval_size: int = 200):
        pairs = (HIGH - LOW + 1) ** 2
        if not 0 < eval_size <= pairs // 2:
            raise ValueError(f"ToolCalcTask: eval_size must be in 1..{pairs // 2}, got {eval_size}")
        rng = random.Random(EVAL_SEED)
        self._eval = rng.sample([(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)], eval_size)
        self._eval_set = frozenset(self._eval)

    @staticmethod
    def _prompt(a: int, b: int) -> Prompt:
        return Prompt(uid=f"toolcalc:{a}*{b}", text=f"{a}*{b}=", answer=str(a * b))

    def prompt_by_id(self, seed: int, prompt_id: int) -> Prompt:
        rng = random.Random(f"toolcalc:{seed}:{prompt_id}")
        while True:
            pair = (rng.randint(LOW, HIGH), rng.randint(LOW, HIGH))
            if pair not in self._eval_set:
                return self._prompt(*pair)

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(a, b) for a, b in self._eval]

    def reference_completion(self, prompt: Prompt) -> str:
        return f"calc {prompt.text.rstrip('=')}{END_OF_TURN}{tool_turn('=' + prompt.answer)}{prompt.answer}"

    def distractor_completion(self, prompt: Prompt) -> str | None:
        a, b = map(int, prompt.text.rstrip("=").split("*"))
        return f"guess {a + b}"

    def score(self, prompt: Prompt, completion_text: str) -> float:
        lines = strip_completion(completion_text).splitlines()
        return 1.0 if lines and lines[-1].strip() == prompt.answer else 0.0
