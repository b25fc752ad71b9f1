"""Held-out evaluation rounds, run through the generators and never stored as training rollouts.

A round is asked for by the trainer (``eval_request``: step, version). The orchestrator splits the
held-out prompts across the connected generators (``eval_work``), which answer each prompt greedily
(sample index 0) and, with ``eval.samples`` = k > 0, with k more completions sampled at
``eval.temperature`` (sample indices 1..k), all in one ``eval_result`` (completion ids and the
versions of their tokens). The orchestrator scores them with the run's scorer and, once every prompt
is answered, writes one ``eval`` metrics record and appends one line per prompt to
``RUN/eval/answers.jsonl`` (step, index, eval_set, data_source, greedy score, sampled scores,
completion token ids: what the record's numbers are counted from).

The ``eval`` record: step, version (the oldest token version seen), requested_version, n, accuracy
(mean greedy reward = pass@1 greedy), and with k > 0: k, pass_at_k (mean over prompts of the best of
the k sampled rewards: for 0/1 rewards the share of prompts with a correct sample),
sampled_accuracy (mean sampled reward). The same three per held-out set (``accuracy/<set>``,
``pass_at_k/<set>``, ``n/<set>``) when the prompts name their set, and per data source
(``accuracy/source/<data_source>``, ...) when they name one.

Worked example: 2 prompts, k = 2, greedy rewards (1, 0), sampled (0, 1) and (0, 0): accuracy 0.5,
pass_at_k 0.5, sampled_accuracy 0.25.

Invariants: at most one round is open at a time (a new request for a later step replaces an
unfinished one, which is reported as abandoned); each prompt counts once per round, and only when
its greedy answer and all k samples came back together; prompts whose generator disappeared are
re-sent to another after ``resend_after_s``.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline.protocol.links import prompt_arrays
from pipeline.protocol.messages import EvalResult, EvalWork, encode
from pipeline.orchestrator.prompts import PromptItem, PromptSource
from pipeline.orchestrator.scoring import Scorer
from pipeline.protocol.record import RecordError, RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.protocol.transport import MessageServer

log = logging.getLogger(__name__)


@dataclass
class EvalRound:
    step: int
    version: int
    pending: dict[int, tuple[bytes, float]] = field(default_factory=dict)
    """Eval prompt index -> (generator it was sent to, when)."""
    scores: dict[int, float] = field(default_factory=dict)
    """Eval prompt index -> greedy reward."""
    sampled: dict[int, list[float]] = field(default_factory=dict)
    """Eval prompt index -> rewards of its k sampled answers."""
    min_version: int | None = None
    started: float = field(default_factory=time.time)


class Evaluator:
    def __init__(self, prompts: PromptSource, scorer: Scorer, schema: RecordSchema,
                 resend_after_s: float = 120.0, samples: int = 0, answers_path: Path | None = None):
        self.prompts, self.scorer, self.schema = prompts, scorer, schema
        self.resend_after_s, self.samples = resend_after_s, samples
        self.answers_path = answers_path
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
        return self.prompts.by_id(index)

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
        rows: dict[int, list[int]] = defaultdict(list)
        for i, idx in enumerate(indices.tolist()):
            rows[idx].append(i)
        answers = []
        for idx, at in rows.items():
            order = sorted(at, key=lambda i: int(batch.columns["sample_index"][i]))
            kinds = [int(batch.columns["sample_index"][i]) for i in order]
            if idx in r.scores or not 0 <= idx < len(self.prompts) or kinds != list(range(self.samples + 1)):
                continue
            group = batch.take(order)
            scores = [float(x) for x in self.scorer.score(group, self.prompt(idx))]
            r.scores[idx], r.sampled[idx] = scores[0], scores[1:]
            v = int(group.min_versions().min())
            r.min_version = v if r.min_version is None else min(r.min_version, v)
            r.pending.pop(idx, None)
            answers.append(self._answer(r.step, idx, scores, [group.tokens("completion_ids", j).tolist()
                                                              for j in range(len(group))]))
        self._write_answers(answers)
        if len(r.scores) < len(self.prompts):
            return None
        self.round = None
        summary = {"step": r.step, "version": r.min_version, "requested_version": r.version,
                   "eval_s": time.time() - r.started, **self._scores(r, range(len(self.prompts)))}
        for label, members in self._breakdown().items():
            summary.update({f"{key}/{label}": value for key, value in self._scores(r, members).items()})
        return summary

    def _meta(self, idx: int) -> tuple[str, str]:
        prompt = self.prompt(idx).answer  # a task's PromptItem carries its Prompt
        return getattr(prompt, "eval_set", ""), getattr(prompt, "data_source", "")

    def _breakdown(self) -> dict[str, list[int]]:
        """Prompt indices per held-out set (label: its name) and per data source (source/<name>)."""
        groups: dict[str, list[int]] = defaultdict(list)
        for idx in range(len(self.prompts)):
            eval_set, source = self._meta(idx)
            if eval_set:
                groups[eval_set].append(idx)
            if source:
                groups[f"source/{source}"].append(idx)
        return groups

    def _scores(self, r: EvalRound, members) -> dict[str, float]:
        members = list(members)
        out = {"n": len(members), "accuracy": float(np.mean([r.scores[i] for i in members]))}
        if self.samples:
            out.update(k=self.samples, pass_at_k=float(np.mean([max(r.sampled[i]) for i in members])),
                       sampled_accuracy=float(np.mean([np.mean(r.sampled[i]) for i in members])))
        return out

    def _answer(self, step: int, idx: int, scores: list[float], completions: list[list[int]]) -> dict:
        eval_set, source = self._meta(idx)
        return {"step": step, "index": idx, "eval_set": eval_set, "data_source": source, "greedy": scores[0],
                "samples": scores[1:], "completion_ids": completions}

    def _write_answers(self, answers: list[dict]) -> None:
        if self.answers_path is None or not answers:
            return
        self.answers_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.answers_path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(a, separators=(",", ":")) + "\n" for a in answers)
