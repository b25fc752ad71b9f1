"""Rewards off the critical path: scorers, the `Scoring` interface, the asynchronous scoring pool,
and group filters.

`Scoring` is what the orchestrator's loop scores through: `AsyncScoring` (scorers in this process)
or `pipeline.scorers.pool.RemoteScoring` (scorer processes). The weight hooks and metrics have
defaults that do nothing, so scoring that no weights concern needs none of them.

Invariants:
- scoring never runs on the orchestrator's event loop: `AsyncScoring.submit` returns at once and
  `AsyncScoring.completed` hands back finished groups in completion order;
- a scorer returns one finite float reward per sample of the group; anything else (an exception,
  a wrong length, NaN) is reported as that group's error, never raised into the loop.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from pipeline.orchestrator.prompts import PromptItem
from pipeline.protocol.sample_batch import SampleBatch


class Scorer:
    """Base class: rewards for one group's samples."""

    def score(self, group: SampleBatch, prompt: PromptItem) -> np.ndarray:
        raise NotImplementedError

    def score_groups(self, batch: SampleBatch, prompts: Sequence[PromptItem]) -> np.ndarray:
        """Rewards for consecutive groups of ``batch`` (``len(batch) // len(prompts)`` samples each,
        group i answering ``prompts[i]``), in row order: what `score` gives each group (the default
        calls it per group; a scorer may do it in one pass)."""
        return np.concatenate([np.asarray(self.score(group, p), dtype=np.float32)
                               for group, p in zip(batch.groups(len(prompts)), prompts)])


class VerifierScorer(Scorer):
    """Applies an exact verifier ``verify(prompt, completion_ids) -> float`` to each sample."""

    def __init__(self, verify: Callable[[PromptItem, np.ndarray], float]):
        self.verify = verify

    def score(self, group: SampleBatch, prompt: PromptItem) -> np.ndarray:
        return self.score_groups(group, [prompt])

    def score_groups(self, batch: SampleBatch, prompts: Sequence[PromptItem]) -> np.ndarray:
        """Every sample of the groups in one pass (one offset count, one array)."""
        ids, ends = batch.columns["completion_ids"], np.cumsum(batch.columns["completion_len"]).tolist()
        per_sample = [p for p in prompts for _ in range(len(ends) // len(prompts))]
        return np.array([self.verify(p, ids[a:b]) for p, a, b in zip(per_sample, [0, *ends], ends)],
                        dtype=np.float32)


def last_token_verifier(prompt: PromptItem, completion_ids: np.ndarray) -> float:
    """Synthetic task's verifier: 1 if the completion starts with the prompt's last token."""
    return float(completion_ids[0] == prompt.answer)


class SubmitFailed(Exception):
    """`Scoring.submit_groups` failed at group ``submitted`` (its ``__cause__``): the groups before it
    were submitted and will be answered, it and those after it were not."""

    def __init__(self, submitted: int, cause: BaseException):
        super().__init__(f"submitting group {submitted} for scoring failed: {cause!r}")
        self.submitted = submitted


class Scoring(ABC):
    """Groups in, (key, group, rewards, error) out, never blocking the orchestrator's loop."""

    @abstractmethod
    def submit(self, key: Any, group: SampleBatch, prompt: PromptItem) -> None:
        """Score ``group`` (of ``prompt``); its answer comes out of `completed` under ``key``."""

    def submit_groups(self, keys: Sequence[Any], batch: SampleBatch, prompts: Sequence[PromptItem]) -> None:
        """`submit` each of ``batch``'s consecutive groups (``len(batch) // len(keys)`` samples
        each; group i under ``keys[i]``, answering ``prompts[i]``), in order; the default submits
        them one by one, as row views. A failure raises `SubmitFailed`, naming how many were submitted
        (any other exception: none was)."""
        for i, (key, group, prompt) in enumerate(zip(keys, batch.groups(len(keys)), prompts)):
            try:
                self.submit(key, group, prompt)
            except Exception as exc:
                raise SubmitFailed(i, exc) from exc

    @abstractmethod
    def completed(self) -> Iterator[tuple[Any, SampleBatch, np.ndarray | None, BaseException | None]]:
        """(key, group, rewards, error) of every finished group, each once; never blocks."""

    @abstractmethod
    def close(self) -> None:
        """The run is over."""

    def bind_clock(self, clock) -> None:
        """Follow the orchestrator's `PolicyClock` (a lagged teacher picks its snapshot by it)."""

    def weight_members(self) -> dict[str, int]:
        """Members of the trainer's weight group this scoring adds: name -> incarnation."""
        return {}

    def regroup(self, weight_epoch: int) -> None:
        """The trainer built the weight group of weight-group epoch ``weight_epoch``."""

    def weights_announced(self, version: int, weight_epoch: int = 0) -> None:
        """The trainer is about to broadcast weights ``version`` into weight-group epoch ``weight_epoch``."""

    def metrics(self) -> dict[str, float]:
        """Counters for the orchestrator's metrics line."""
        return {}


class AsyncScoring(Scoring):
    """Scores groups in a thread pool beside the event loop, or inline when ``threads == 0``.

    Inline suits exact verifiers (microseconds per sample: a thread hand-off would cost more than
    the scoring); threads suit reward models and remote scorer services.
    """

    def __init__(self, scorer: Scorer, threads: int = 0):
        self.scorer = scorer
        self.pool = (ThreadPoolExecutor(max_workers=threads, thread_name_prefix="scorer")
                     if threads > 0 else None)
        self.pending: dict[Any, tuple[Future, SampleBatch]] = {}
        """The pool's groups being scored."""
        self.scored: list[tuple[Any, SampleBatch, np.ndarray | None, BaseException | None]] = []
        """Groups scored inline, not yet handed back (no `Future`: its lock costs more than the scoring)."""

    def submit(self, key: Any, group: SampleBatch, prompt: PromptItem) -> None:
        if self.pool is not None:
            self.pending[key] = (self.pool.submit(self._score, group, prompt), group)
            return
        try:
            self.scored.append((key, group, self._score(group, prompt), None))
        except Exception as exc:  # reported per group, like a pool's failure
            self.scored.append((key, group, None, exc))

    def submit_groups(self, keys: Sequence[Any], batch: SampleBatch, prompts: Sequence[PromptItem]) -> None:
        """Inline: the groups scored in one pass (`Scorer.score_groups`) and handed back as row
        views with their slices of the rewards. If that pass fails (or returns a bad reward), each
        group is scored alone, so the error is reported for the group(s) it belongs to and the
        others are scored as if submitted alone."""
        if self.pool is not None:
            super().submit_groups(keys, batch, prompts)
            return
        try:
            rewards = checked_rewards(self.scorer.score_groups(batch, prompts), len(batch))
        except Exception:  # noqa: BLE001 - found and reported per group below
            super().submit_groups(keys, batch, prompts)
            return
        for key, group, group_rewards in zip(keys, batch.groups(len(keys)), np.split(rewards, len(keys))):
            self.scored.append((key, group, group_rewards, None))

    def _score(self, group: SampleBatch, prompt: PromptItem) -> np.ndarray:
        return checked_rewards(self.scorer.score(group, prompt), len(group))

    def completed(self) -> Iterator[tuple[Any, SampleBatch, np.ndarray | None, BaseException | None]]:
        """(key, group, rewards, error) of every finished group, removing it from pending."""
        scored, self.scored = self.scored, []
        yield from scored
        done = [k for k, (f, _) in self.pending.items() if f.done()]
        for key in done:
            fut, group = self.pending.pop(key)
            exc = fut.exception()
            yield key, group, (None if exc else fut.result()), exc

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def checked_rewards(rewards: Any, samples: int) -> np.ndarray:
    """A scorer's rewards for ``samples`` samples as float32, or ValueError naming what is wrong."""
    rewards = np.asarray(rewards, dtype=np.float32)
    if rewards.shape != (samples,):
        raise ValueError(f"scorer returned shape {rewards.shape} for {samples} samples")
    if not np.isfinite(rewards).all():
        raise ValueError("scorer returned a non-finite reward")
    return rewards


def keep_all(rewards: np.ndarray) -> bool:
    return True


def drop_zero_variance(rewards: np.ndarray) -> bool:
    """GRPO learns nothing from a group whose samples all scored the same."""
    return bool(rewards.max() - rewards.min() > 1e-6)


GROUP_FILTERS: dict[str, Callable[[np.ndarray], bool]] = {
    "none": keep_all,
    "zero_variance": drop_zero_variance,
}


def with_rewards(batch: SampleBatch, rewards: np.ndarray) -> SampleBatch:
    """The group with its scored rewards filled in."""
    return batch.with_column("reward", rewards.astype(np.float32))
