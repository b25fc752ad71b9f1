"""Users' prompt/answer data from JSON Lines files, scored by the math-answer verifier.

File format: one JSON object per line with a non-empty string "prompt" and an "answer" (string or
number); blank lines are skipped; other keys are ignored. Any other row is refused with an error naming
the file and the 1-based line number, e.g. `data.jsonl:7: "answer" is missing`.

Invariants:
- Held-out set: the rows of `eval_path` if given, otherwise `min(eval_size, rows // 5)` rows of `path`
  picked with a fixed seed; training rows never include a prompt text of the held-out set.
- `train_prompts(seed)` walks the training rows epoch after epoch, each epoch in an order drawn from
  `random.Random(seed)`: deterministic.
- Reward: 1.0 when the completion's answer (last \\boxed{...}, else last number) matches the reference
  (pipeline.tasks.math_answer), else 0.0.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from pipeline.tasks.base import Prompt, Task
from pipeline.tasks.math_answer import answers_match, extract_answer

# Seed of the held-out split when no eval file is given: part of the task's definition.
SPLIT_SEED = 1_234_567


def load_jsonl(path: Path) -> list[Prompt]:
    """Parse and validate a prompt/answer file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSONL task file {path} does not exist")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object with 'prompt' and 'answer', got {type(row).__name__}")
            for key in ("prompt", "answer"):
                if key not in row:
                    raise ValueError(f"{where}: {key!r} is missing")
            text, answer = row["prompt"], row["answer"]
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{where}: 'prompt' must be a non-empty string")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise ValueError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
            answer = str(answer).strip()
            if not answer:
                raise ValueError(f"{where}: 'answer' is empty")
            prompts.append(Prompt(uid=f"{path.name}:{lineno}", text=text, answer=answer))
    if not prompts:
        raise ValueError(f"JSONL task file {path} has no rows")
    return prompts


class JsonlTask(Task):
    """Prompts and reference answers from a JSONL file (optionally a separate eval file)."""

    name = "jsonl"

    def __init__(self, path: str | Path, eval_path: str | Path | None = None, eval_size: int = 200):
        rows = load_jsonl(Path(path))
        if eval_path is not None:
            self._eval = load_jsonl(Path(eval_path))
        else:
            n_eval = min(eval_size, len(rows) // 5)
            if n_eval == 0:
                raise ValueError(f"{path}: {len(rows)} rows are too few to hold out an eval set (need >= 5)")
            held = set(random.Random(SPLIT_SEED).sample(range(len(rows)), n_eval))
            self._eval = [rows[i] for i in sorted(held)]
        eval_texts = {p.text for p in self._eval}
        self._train = [p for p in rows if p.text not in eval_texts]
        if not self._train:
            raise ValueError(f"{path}: every row's prompt is also in the eval set; no training rows remain")

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        while True:
            order = list(range(len(self._train)))
            rng.shuffle(order)
            for i in order:
                yield self._train[i]

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    def score(self, prompt: Prompt, completion_text: str) -> float:
        predicted = extract_answer(completion_text)
        return 1.0 if predicted is not None and answers_match(predicted, prompt.answer) else 0.0

    def reference_completion(self, prompt: Prompt) -> str:
        return f"\\boxed{{{prompt.answer}}}"
