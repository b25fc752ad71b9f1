"""Prompt sources: which prompt a group id gets, tokenized once.

Invariants:
- the prompt of a group is a pure function of (source, seed, group id): group g takes position g of
  a stream that walks seeded permutations of the dataset, epoch after epoch. The cursor is thus just
  the next group id, and a re-issued or resumed group gets exactly the prompt it had before;
- each prompt is tokenized once (`docs/architecture.md`, "Contracts") and cached; generators and the trainer receive ids.

Worked example: 3 prompts, seed 7: epoch 0 might be the permutation [2, 0, 1] and epoch 1 [1, 2, 0],
so groups 0..5 get prompts 2, 0, 1, 1, 2, 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np

from pipeline.protocol.record import RecordError
from pipeline.protocol.sample_batch import SampleBatch


@dataclass(frozen=True)
class PromptItem:
    prompt_id: int
    token_ids: np.ndarray
    """int32 prompt token ids (chat template applied if the task uses one)."""
    answer: Any = None
    """What the verifier compares against (task-specific); never sent to generators."""


class PromptSource:
    """Base class: a finite, indexable prompt dataset walked in seeded epochs."""

    def __init__(self, seed: int):
        self.seed = seed

    def __len__(self) -> int:
        raise NotImplementedError

    def load(self, prompt_id: int) -> PromptItem:
        """Tokenized prompt ``prompt_id`` (called at most once per prompt thanks to the cache)."""
        raise NotImplementedError

    def prompt_id_for_group(self, group_id: int) -> int:
        n = len(self)
        epoch, pos = divmod(group_id, n)
        return int(_permutation(self.seed, epoch, n)[pos])

    @lru_cache(maxsize=4096)
    def for_group(self, group_id: int) -> PromptItem:
        """Group ``group_id``'s prompt (a group's is looked up ~4 times, from its grant to its
        resolution: the recent groups' are kept)."""
        return self.by_id(self.prompt_id_for_group(group_id))

    @lru_cache(maxsize=65536)
    def by_id(self, prompt_id: int) -> PromptItem:
        """Prompt ``prompt_id``, tokenized once (the most recent 65,536 are kept)."""
        return self.load(prompt_id)


@lru_cache(maxsize=8)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class SyntheticPromptSource(PromptSource):
    """Random token-id prompts: a data-plane load for tests and benchmarks (no tokenizer). They
    are drawn `SYNTHETIC_BLOCK` at a time (one generator per block: a prompt costs a slice, not
    a generator's construction), each a pure function of (seed, prompt id)."""

    def __init__(self, n_prompts: int = 1000, vocab_size: int = 1000, min_len: int = 8,
                 max_len: int = 64, seed: int = 0):
        super().__init__(seed)
        self.n, self.vocab, self.min_len, self.max_len = n_prompts, vocab_size, min_len, max_len
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        """Block -> its prompts' start offsets (and end) and their ids back to back."""

    def __len__(self) -> int:
        return self.n

    def load(self, prompt_id: int) -> PromptItem:
        block, i = divmod(prompt_id, SYNTHETIC_BLOCK)
        if block not in self._blocks:
            if len(self._blocks) >= 256:  # as many prompts as `PromptSource.by_id` keeps
                self._blocks.clear()
            rng = np.random.default_rng([self.seed, 1 << 20, block])
            lens = rng.integers(self.min_len, self.max_len + 1, SYNTHETIC_BLOCK)
            ids = rng.integers(0, self.vocab, int(lens.sum()), dtype=np.int32)
            ids.flags.writeable = False
            self._blocks[block] = (np.concatenate(([0], np.cumsum(lens))), ids)
        offsets, all_ids = self._blocks[block]
        ids = all_ids[offsets[i]:offsets[i + 1]]
        return PromptItem(prompt_id, ids, answer=int(ids[-1]))


SYNTHETIC_BLOCK = 256
"""Synthetic prompts drawn together (consecutive prompt ids)."""


class TextPromptSource(PromptSource):
    """Prompts given as (text or chat messages, answer), tokenized by an encode function."""

    def __init__(self, items: Sequence[tuple[Any, Any]], encode: Callable[[Any], Sequence[int]],
                 seed: int = 0):
        super().__init__(seed)
        if not items:
            raise ValueError("the prompt dataset is empty")
        self.items, self.encode = items, encode

    def __len__(self) -> int:
        return len(self.items)

    def load(self, prompt_id: int) -> PromptItem:
        prompt, answer = self.items[prompt_id]
        ids = np.asarray(self.encode(prompt), dtype=np.int32)
        if ids.size == 0:
            raise ValueError(f"prompt {prompt_id} tokenizes to nothing")
        return PromptItem(prompt_id, ids, answer)


def check_groups(batch: SampleBatch, leased: Sequence[tuple[int, int, PromptItem]], group_size: int) -> None:
    """Raise `RecordError` unless ``batch`` is whole groups, ``group_size`` samples each in the
    order of ``leased`` (group id, attempt, prompt), each answering its prompt as leased."""
    c, k = batch.columns, len(leased)
    if len(batch) != k * group_size:
        raise RecordError(f"{len(batch)} samples, {k} group(s) of size {group_size}")
    gids, attempts, prompts = zip(*leased) if k else ((), (), ())
    if ((c["group_id"] != np.repeat(gids, group_size)).any()
            or (c["attempt"] != np.repeat(attempts, group_size)).any()):
        raise RecordError("samples carry another group id or attempt than the message")
    if not (np.sort(c["sample_index"].reshape(k, group_size), axis=1) == np.arange(group_size)).all():
        raise RecordError("sample indices are not 0..G-1")
    if (c["prompt_id"] != np.repeat([p.prompt_id for p in prompts], group_size)).any():
        raise RecordError(f"prompt id differs from the group's prompt {', '.join(str(p.prompt_id) for p in prompts)}")
    lens = [len(p.token_ids) for p in prompts]
    if ((c["prompt_len"] != np.repeat(lens, group_size)).any()
            or not np.array_equal(c["prompt_ids"], np.concatenate(
                [p.token_ids for p in prompts for _ in range(group_size)]) if k else c["prompt_ids"])):
        raise RecordError("prompt tokens differ from the issued prompt")
