"""Held-out evaluation rounds, run through the generators and never stored as training rollouts.

A round is asked for by the trainer (``eval_request``: step, version). The orchestrator splits the
held-out prompts across the connected generators (``eval_work``), which answer greedily
(``eval_result``: completion ids per prompt and the versions of their tokens); the orchestrator
scores them with the run's scorer and, once every prompt is answered, writes one ``eval`` metrics
record: step, version (the oldest token version seen), accuracy, n.

Invariants: at most one round is open at a time (a new request for a later step replaces an
unfinished one, which is reported as abandoned); each prompt counts once per round; prompts
whose generator disappeared are re-sent to another after ``resend_after_s``.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pipeline.protocol.links import prompt_arrays
from pipeline.protocol.messages import EvalResult, EvalWork, encode
from pipeline.orchestrator.prompts import PromptItem, PromptSource
from pipeline.orchestrator.scoring import Scorer
from pipeline.protocol.record import RecordError, RecordSchema, SampleBatch
from pipeline.protocol.transport import MessageServer

log = logging.getLogger(__name__)


@dataclass
class EvalRound:
    step: int
    version: int
    pending: dict[int, tuple[bytes, float]] = field(default_factory=dict)
    """Eval prompt index -> (generator it was sent to, when)."""
    scores: dict[int, float] = field(default_factory=dict)
    min_version: int | None = None
    started: float = field(default_factory=time.time)


class Evaluator:
    def __init__(self, prompts: PromptSource, scorer: Scorer, schema: RecordSchema,
                 resend_after_s: float = 120.0):
        self.prompts, self.scorer, self.schema = prompts, scorer, schema
        self.resend_after_s = resend_after_s
        self.round: EvalRound | None = None
        self.abandoned = 0

    def start(self, step: int, version: int) -> None:
        if self.round is not None:
            if step <= self.round.step:
                return  # a repeated request for the round already running
            self.abandoned += 1
        self.round = EvalRound(step, version)

    def assignments(self, generators: list[bytes]) -> dict[bytes, list[int]]:
        """Prompts to send now: unsent ones and those whose answer is overdue, spread round-robin."""
        r = self.round
        if r is None or not generators:
            return {}
        now = time.time()
        todo = [i for i in range(len(self.prompts))
                if i not in r.scores and (i not in r.pending or now - r.pending[i][1] > self.resend_after_s)]
        out: dict[bytes, list[int]] = {}
        for j, i in enumerate(todo):
            peer = generators[j % len(generators)]
            out.setdefault(peer, []).append(i)
            r.pending[i] = (peer, now)
        return out

    def prompt(self, index: int) -> PromptItem:
        return self.prompts._cached(index)

    def send_work(self, server: MessageServer, generators: list[bytes]) -> None:
        """Send the round's unsent (or overdue) prompts to the generators."""
        if self.round is None:
            return
        for peer, indices in self.assignments(generators).items():
            prompts = [self.prompt(i).token_ids for i in indices]
            server.send(peer, *encode(EvalWork(self.round.step, indices, prompt_arrays(prompts))))

    def on_result(self, peer: bytes, msg: EvalResult, counts: Counter,
                  check: Callable[[SampleBatch], None]) -> dict | None:
        """Record a generator's answers (``check``: the run's bounds, raising `RecordError`); the
        round's summary once it is complete."""
        arrays = dict(msg.arrays)
        indices = arrays.pop("eval_index")  # a frame `EvalResult` requires
        try:
            batch = SampleBatch(arrays, self.schema)
            if indices.dtype.kind not in "iu" or indices.shape != (len(batch),):
                raise RecordError(f"eval_index is {indices.dtype}{list(indices.shape)}, expected one "
                                  f"integer per answer ({len(batch)})")
            if len(batch) and not 0 <= int(indices.min()) <= int(indices.max()) < len(self.prompts):
                raise RecordError(f"eval_index holds {int(indices.min())}..{int(indices.max())}, the "
                                  f"held-out set has {len(self.prompts)} prompts")
            check(batch)
        except RecordError as exc:
            counts["invalid_eval_result"] += 1
            log.warning("invalid eval result from %r: %s", peer, exc)
            return None
        return self.record(msg.step, indices, batch)

    def record(self, step: int, indices: np.ndarray, batch: SampleBatch) -> dict | None:
        """Score answers of a round; returns the round's summary once it is complete."""
        r = self.round
        if r is None or step != r.step:
            return None
        for i, idx in enumerate(indices.tolist()):
            if idx in r.scores or not 0 <= idx < len(self.prompts):
                continue
            one = batch.take([i])
            r.scores[idx] = float(self.scorer.score(one, self.prompt(idx))[0])
            v = int(one.min_versions()[0])
            r.min_version = v if r.min_version is None else min(r.min_version, v)
            r.pending.pop(idx, None)
        if len(r.scores) < len(self.prompts):
            return None
        self.round = None
        return {"step": r.step, "version": r.min_version, "requested_version": r.version,
                "accuracy": float(np.mean(list(r.scores.values()))), "n": len(r.scores),
                "eval_s": time.time() - r.started}
