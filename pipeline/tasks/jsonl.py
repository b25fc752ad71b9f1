"""Users' prompt/answer data from JSON Lines files, indexed by byte offset (any file size).

File format (docs/data.md): one JSON object per line with a non-empty string "prompt" and an "answer"
(string or number); blank lines are skipped; other keys are ignored. Any other row is refused with an
error naming the file and the 1-based line number, e.g. `data.jsonl:7: "answer" is missing`.

Invariants:
- The file is read once when the task is built: every row is validated and only its byte range, line
  number and an 8-byte hash of its prompt text stay in memory (24 bytes a row); a row's text is read
  back with `os.pread` when its prompt is needed. 10 M rows take ~240 MB of index, never the file.
- Held-out set: the rows of `eval_path` if given, otherwise `min(eval_size, floor(rows * eval_fraction))`
  rows of `path` picked with `random.Random(split_seed)`; a training row never has the prompt text of a
  held-out row (compared by hash, so a hash collision can only drop a training row, never leak one).
- Data order: position p of seed s is epoch e = p // n, slot p % n of epoch e, n = training rows;
  with `shuffle` the slot is mapped through `numpy.random.default_rng([s, e]).permutation(n)`, else rows
  go in file order. The prompt id is the row's index among the training rows. Worked example: 3 rows,
  seed 7: epoch 0 might be [2, 0, 1] and epoch 1 [1, 2, 0], so positions 0..5 take rows 2, 0, 1, 1, 2, 0.
  `epochs` is not a cap: a run that needs more positions than `epochs * n` is refused at launch
  (pipeline.models.defaults), and positions beyond (groups leased ahead or re-drawn after a staleness
  drop) continue into the next epoch.
- Reward: the `verifier` function when configured (``module:function``, called as
  ``fn(completion_text, answer, prompt_text) -> float`` in [0, 1]), else 1.0 when the completion's answer
  (last \\boxed{...}, else last number) matches the reference (pipeline.tasks.math_answer), else 0.0.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import random
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np

from pipeline.tasks.base import Prompt, Task
from pipeline.tasks.math_answer import answers_match, extract_answer

# Default seed of the held-out split when no eval file is given.
SPLIT_SEED = 1_234_567


def _text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def parse_row(line: bytes | str, where: str) -> tuple[str, str]:
    """(prompt text, answer) of one non-blank line; ValueError naming `where` otherwise."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
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
    return text, answer


class JsonlFile:
    """A validated JSONL file as a byte-offset index (see the module invariants)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"JSONL task file {self.path} does not exist")
        starts, ends, lines, hashes = [], [], [], []
        offset = 0
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    text, _ = parse_row(line, f"{self.path}:{lineno}")
                    starts.append(offset)
                    ends.append(offset + len(line))
                    lines.append(lineno)
                    hashes.append(_text_hash(text))
                offset += len(line)
        if not starts:
            raise ValueError(f"JSONL task file {self.path} has no rows")
        self.starts, self.ends = np.array(starts, np.int64), np.array(ends, np.int64)
        self.lines, self.hashes = np.array(lines, np.int64), np.array(hashes, np.int64)
        self._fd = os.open(self.path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self.starts)

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def row(self, i: int) -> Prompt:
        start, end = int(self.starts[i]), int(self.ends[i])
        raw = os.pread(self._fd, end - start, start)
        where = f"{self.path}:{int(self.lines[i])}"
        if len(raw) != end - start:
            raise ValueError(f"{where}: the file changed while the run used it (short read)")
        text, answer = parse_row(raw, where)
        return Prompt(uid=f"{self.path.name}:{int(self.lines[i])}", text=text, answer=answer)


def load_verifier(spec: str) -> Callable[[str, str, str], float]:
    """The function named by ``task.verifier`` ("package.module:function"), imported and checked."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"task.verifier must be 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task.verifier={spec!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise ValueError(f"task.verifier={spec!r} is not callable")
    return fn


@lru_cache(maxsize=8)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class JsonlTask(Task):
    """Prompts and reference answers from a JSONL file (optionally a separate eval file)."""

    name = "jsonl"

    def __init__(self, path: str | Path, eval_path: str | Path | None = None, eval_size: int = 200,
                 eval_fraction: float = 0.2, split_seed: int = SPLIT_SEED, shuffle: bool = True,
                 verifier: str | None = None):
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"task.eval_fraction must be in (0, 1), got {eval_fraction}")
        self.file = JsonlFile(path)
        n = len(self.file)
        if eval_path is not None:
            held_file = JsonlFile(eval_path)
            self._eval = [held_file.row(i) for i in range(len(held_file))]
            held_hashes = held_file.hashes
        else:
            n_eval = min(eval_size, int(n * eval_fraction))
            if n_eval == 0:
                raise ValueError(f"{path}: {n} rows are too few to hold out an eval set with "
                                 f"task.eval_fraction={eval_fraction} (give task.eval_path instead)")
            held = sorted(random.Random(split_seed).sample(range(n), n_eval))
            self._eval = [self.file.row(i) for i in held]
            held_hashes = self.file.hashes[held]
        self._train_rows = np.flatnonzero(~np.isin(self.file.hashes, held_hashes))
        if not len(self._train_rows):
            raise ValueError(f"{path}: every row's prompt is also in the eval set; no training rows remain")
        self.train_size = len(self._train_rows)
        self.shuffle = shuffle
        self._verifier = load_verifier(verifier) if verifier else None

    def prompt_id(self, seed: int, position: int) -> int:
        epoch, slot = divmod(position, self.train_size)
        return int(_permutation(seed, epoch, self.train_size)[slot]) if self.shuffle else slot

    def prompt_by_id(self, seed: int, prompt_id: int) -> Prompt:
        return self.file.row(int(self._train_rows[prompt_id]))

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    def score(self, prompt: Prompt, completion_text: str) -> float:
        if self._verifier is not None:
            reward = float(self._verifier(completion_text, prompt.answer, prompt.text))
            if not 0.0 <= reward <= 1.0:
                raise ValueError(f"task.verifier returned {reward} for {prompt.uid}; rewards must be in [0, 1]")
            return reward
        predicted = extract_answer(completion_text)
        return 1.0 if predicted is not None and answers_match(predicted, prompt.answer) else 0.0

    def reference_completion(self, prompt: Prompt) -> str:
        return f"\\boxed{{{prompt.answer}}}"
