"""Users' datasets as they have them: JSONL, Parquet, Arrow files and `datasets.save_to_disk`
directories, read through Hugging Face `datasets` (docs/data.md).

Reading: ``.jsonl``/``.json`` (one object a line) with ``Dataset.from_generator`` as (line number,
line text) rows, so each row keeps its own types and its line number; ``.parquet`` with
``Dataset.from_parquet``, ``.arrow`` with ``Dataset.from_file``, a directory with ``load_from_disk``
(a DatasetDict: its `task.split`). Every one ends memory-mapped from Arrow files (JSONL and Parquet
are converted once into the `datasets` cache, keyed by the file's path, size and mtime), so a row is
read back by index at any time: the task keeps only the indices of its valid rows and an 8-byte hash
of each prompt (16 bytes a row). `HF_DATASETS_OFFLINE`
and `HF_HUB_OFFLINE` are set (unless the environment says otherwise) before `datasets` is imported:
compute nodes have no internet and a local file needs none.

Columns (`task.columns`, keys prompt / answer / data_source / extra_info, values column names, a dot
for a field inside a struct): unset keys take ``prompt``; ``answer``, else verl's
``reward_model.ground_truth``; ``data_source`` and ``extra_info`` when present. So verl's layout
needs no mapping. A prompt is a non-empty string (one user turn) or a chat list of
``{"role", "content"}`` (rendered by the tokenizer's chat template as is); an answer is a non-empty
string or a number.

Invariants:
- Every row is validated when the task is built (at launch, before anything starts): a bad one
  raises ValueError naming the file and the row (0-based index, e.g. ``data.parquet: row 6: 'answer'
  is empty``; JSONL: the 1-based line, e.g. ``data.jsonl:7: not valid JSON``), or with
  ``on_bad_row=skip`` is left out and counted (`counts["bad_rows"]`).
- Held-out sets: the named files of `eval_sets` (same columns), else ``min(eval_size,
  floor(rows * eval_fraction))`` rows of `path` drawn with `random.Random(split_seed)`, named
  ``heldout``. A training row never has the prompt of a held-out row (compared by hash: a collision
  can only drop a training row, never leak one).
- Data order: position p of seed s is epoch e = p // n, slot p % n (n training rows); with `shuffle`
  the slot goes through `numpy.random.default_rng([s, e]).permutation(n)`, else file order. The prompt
  id is the row's index among the training rows. Worked example: 3 rows, seed 7: epoch 0 might be
  [2, 0, 1] and epoch 1 [1, 2, 0], so positions 0..5 take rows 2, 0, 1, 1, 2, 0. `drop_training_rows`
  (prompts over the token budget, pipeline.tasks.sources) shrinks n before any position is served.
- Reward: the verifier of the row's `data_source` in `reward_by_source`, else `verifier`
  (pipeline.tasks.verifiers); a reward outside [0, 1] raises ValueError naming the row.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from collections import Counter
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.tasks.base import Prompt, Task
from pipeline.tasks.verifiers import DEFAULT_VERIFIER, load_verifier

#: Default seed of the held-out split when no eval set is given.
SPLIT_SEED = 1_234_567
#: Name of the held-out set split off `path` when no `eval_sets` are given.
HELDOUT = "heldout"
COLUMN_KEYS = ("prompt", "answer", "data_source", "extra_info")
BAD_ROW_POLICIES = ("error", "skip")


def _text_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def open_dataset(path: str | Path, split: str = "train"):
    """The `datasets.Dataset` at `path` (see the module doc for the formats)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if path.is_dir():
        if not any((path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            raise ValueError(f"{path} is a directory but not a `datasets.save_to_disk` one (no state.json "
                             "or dataset_dict.json)")
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{path} holds the splits {sorted(ds)}; pick one with task.split")
            ds = ds[split]
        return ds
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        stat = path.stat()  # part of the cache key: a changed file is converted again
        features = datasets.Features({"line": datasets.Value("int64"), "json": datasets.Value("string")})
        try:
            return datasets.Dataset.from_generator(_jsonl_lines, features=features, gen_kwargs={
                "path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
        except Exception as exc:  # e.g. a file of blank lines: "corresponds to no data"
            raise ValueError(f"dataset {path} has no valid rows ({exc})") from None
    if suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path))
    if suffix == ".arrow":
        return datasets.Dataset.from_file(str(path))
    raise ValueError(f"{path}: unknown dataset format {suffix!r} (.jsonl, .json, .parquet, .arrow or a "
                     "`datasets.save_to_disk` directory)")


def _jsonl_lines(path: str, size: int, mtime_ns: int):
    """A JSONL file's non-blank lines as (line number, text): every row keeps its own types and line."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield {"line": lineno, "json": line.decode("utf-8", errors="replace")}


def _field(row: dict, dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


class DatasetFile:
    """One dataset's valid rows (indices and prompt hashes) with its column mapping."""

    def __init__(self, path: str | Path, columns: dict[str, str] | None = None, on_bad_row: str = "error",
                 split: str = "train"):
        if on_bad_row not in BAD_ROW_POLICIES:
            raise ValueError(f"task.on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
        self.path = Path(path)
        self.ds = open_dataset(self.path, split)
        self.jsonl = self.path.suffix.lower() in (".jsonl", ".json")
        self.columns = self._resolve_columns(dict(columns or {}))
        rows, hashes, self.bad_rows = [], [], 0
        for i in range(0, len(self.ds), 4096):
            batch = self.ds[i:i + 4096]
            for j in range(len(next(iter(batch.values())))):
                try:
                    prompt = self._parse({k: v[j] for k, v in batch.items()}, i + j)
                except ValueError:
                    if on_bad_row == "error":
                        raise
                    self.bad_rows += 1
                    continue
                rows.append(i + j)
                hashes.append(_text_hash(prompt_key(prompt)))
        if not rows:
            raise ValueError(f"dataset {self.path} has no valid rows ({self.bad_rows} bad)")
        self.rows, self.hashes = np.array(rows, np.int64), np.array(hashes, np.int64)

    def _record(self, stored: dict, i: int) -> tuple[str, Any]:
        """(where, the row as a dict) of a stored row: a JSONL line is parsed here."""
        if not self.jsonl:
            return f"{self.path}: row {i}", stored
        where = f"{self.path}:{stored['line']}"
        try:
            row = json.loads(stored["json"])
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        return where, row

    def _column_names(self) -> set[str]:
        if not self.jsonl:
            return set(self.ds.column_names)
        names: set[str] = set()
        for k in range(min(len(self.ds), 100)):
            try:
                names |= set(self._record(self.ds[k], k)[1])
            except ValueError:
                continue
        return names

    def _resolve_columns(self, given: dict[str, str]) -> dict[str, str]:
        unknown = set(given) - set(COLUMN_KEYS)
        if unknown:
            raise ValueError(f"task.columns has unknown keys {sorted(unknown)} (known: {list(COLUMN_KEYS)})")
        names = self._column_names()
        auto = {"prompt": "prompt", "answer": "answer" if "answer" in names else "reward_model.ground_truth",
                "data_source": "data_source", "extra_info": "extra_info"}
        resolved = {}
        for key in COLUMN_KEYS:
            column = given.get(key, auto[key])
            if column.split(".")[0] not in names:
                if key in given or key in ("prompt", "answer"):
                    raise ValueError(f"{self.path}: no column {column!r} for task.columns.{key} (columns: "
                                     f"{sorted(names)})")
                continue
            resolved[key] = column
        return resolved

    def _parse(self, stored: dict, i: int) -> Prompt:
        where, row = self._record(stored, i)
        raw_prompt, answer = _field(row, self.columns["prompt"]), _field(row, self.columns["answer"])
        messages = None
        if isinstance(raw_prompt, list):
            if not raw_prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                         and isinstance(m.get("content"), str) for m in raw_prompt):
                raise ValueError(f"{where}: a chat-list prompt needs {{'role', 'content'}} strings in every turn")
            messages = tuple((m["role"], m["content"]) for m in raw_prompt)
            text = next((c for r, c in reversed(messages) if r == "user"), messages[-1][1])
        elif isinstance(raw_prompt, str) and raw_prompt.strip():
            text = raw_prompt
        else:
            problem = "is missing" if raw_prompt is None else "must be a non-empty string or a chat list"
            raise ValueError(f"{where}: {self.columns['prompt']!r} {problem}")
        if answer is None:
            raise ValueError(f"{where}: {self.columns['answer']!r} is missing")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: {self.columns['answer']!r} must be a string or a number, got "
                             f"{type(answer).__name__}")
        answer = str(answer).strip()
        if not answer:
            raise ValueError(f"{where}: {self.columns['answer']!r} is empty")
        source = _field(row, self.columns["data_source"]) if "data_source" in self.columns else None
        extra = _field(row, self.columns["extra_info"]) if "extra_info" in self.columns else None
        return Prompt(uid=f"{self.path.name}:{stored['line'] if self.jsonl else i}", text=text, answer=answer, messages=messages,
                      data_source=str(source) if source is not None else "",
                      extra_info=json.dumps(extra, default=str) if extra is not None else None)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, k: int, eval_set: str = "") -> Prompt:
        """The k-th valid row, read back from the memory-mapped dataset."""
        i = int(self.rows[k])
        prompt = self._parse(self.ds[i], i)
        return replace(prompt, eval_set=eval_set) if eval_set else prompt


def prompt_key(prompt: Prompt) -> str:
    """What makes two prompts the same prompt (held-out overlap): the text or the whole chat."""
    return json.dumps(prompt.messages) if prompt.messages else prompt.text


@lru_cache(maxsize=8)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class DatasetTask(Task):
    """Prompts and ground truths from a user's dataset (see the module invariants)."""

    name = "dataset"
    warmstart_steps = 0  # a user's data trains the model as given, the tiny ones too (a 120-step warm-start: minutes)

    def __init__(self, path: str | Path, *, columns: dict[str, str] | None = None, eval_sets: dict[str, str] | None = None,
                 eval_size: int = 200, eval_fraction: float = 0.2, split_seed: int = SPLIT_SEED,
                 shuffle: bool = True, verifier: str | None = None, reward_by_source: dict[str, str] | None = None,
                 on_bad_row: str = "error", split: str = "train"):
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"task.eval_fraction must be in (0, 1), got {eval_fraction}")
        self.file = DatasetFile(path, columns, on_bad_row, split)
        self.counts: Counter = Counter(bad_rows=self.file.bad_rows)
        n = len(self.file)
        if eval_sets:
            self._eval, held = [], []
            for set_name, set_path in eval_sets.items():
                held_file = DatasetFile(set_path, columns, on_bad_row, split)
                self.counts["bad_rows"] += held_file.bad_rows
                self._eval += [held_file.row(k, set_name) for k in range(len(held_file))]
                held.append(held_file.hashes)
            held_hashes = np.concatenate(held)
        else:
            n_eval = min(eval_size, int(n * eval_fraction))
            if n_eval == 0:
                raise ValueError(f"{path}: {n} rows are too few to hold out an eval set with "
                                 f"task.eval_fraction={eval_fraction} (give task.eval_sets instead)")
            held_rows = sorted(random.Random(split_seed).sample(range(n), n_eval))
            self._eval = [self.file.row(k, HELDOUT) for k in held_rows]
            held_hashes = self.file.hashes[held_rows]
        self._train_rows = np.flatnonzero(~np.isin(self.file.hashes, held_hashes))
        if not len(self._train_rows):
            raise ValueError(f"{path}: every row's prompt is also in the eval set; no training rows remain")
        self.train_size = len(self._train_rows)
        self.shuffle = shuffle
        self._default = load_verifier(verifier or DEFAULT_VERIFIER)
        self._by_source = {src: load_verifier(spec, f"task.reward_by_source.{src}")
                           for src, spec in (reward_by_source or {}).items()}

    def drop_training_rows(self, prompt_ids: list[int]) -> None:
        """Leave these training prompt ids out of the data order (e.g. prompts over the token budget)."""
        keep = np.ones(self.train_size, bool)
        keep[np.asarray(prompt_ids, np.int64)] = False
        if not keep.any():
            raise ValueError(f"{self.file.path}: no training rows remain after dropping {len(prompt_ids)}")
        self._train_rows = self._train_rows[keep]
        self.train_size = len(self._train_rows)

    def drop_eval_prompts(self, uids: set[str]) -> None:
        self._eval = [p for p in self._eval if p.uid not in uids]

    def prompt_id(self, seed: int, position: int) -> int:
        epoch, slot = divmod(position, self.train_size)
        return int(_permutation(seed, epoch, self.train_size)[slot]) if self.shuffle else slot

    def prompt_by_id(self, seed: int, prompt_id: int) -> Prompt:
        return self.file.row(int(self._train_rows[prompt_id]))

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        if prompt.messages:
            return [{"role": role, "content": content} for role, content in prompt.messages]
        return super().messages(prompt)

    def score(self, prompt: Prompt, completion_text: str) -> float:
        verify = self._by_source.get(prompt.data_source, self._default)
        reward = float(verify(completion_text, prompt.answer, prompt.text, prompt.data_source, prompt.extra_info))
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"the verifier returned {reward} for {prompt.uid}; rewards must be in [0, 1]")
        return reward

    def reference_completion(self, prompt: Prompt) -> str:
        return f"\\boxed{{{prompt.answer}}}"
