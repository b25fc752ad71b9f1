"""A checked batch's groups are scored together (`pipeline.orchestrator.scoring`:
`Scoring.submit_groups`, `Scorer.score_groups`): inline, in one pass over every sample, with the
same rewards as each group scored alone; a failure or a bad reward in that pass is reported for
its own group only, the others scored as if each had come alone. The reference is each sample's
reward computed here from its own completion and prompt."""
from __future__ import annotations

import time

import numpy as np
import pytest

from pipeline.orchestrator.prompts import SyntheticPromptSource
from pipeline.orchestrator.scoring import AsyncScoring, Scorer, VerifierScorer, last_token_verifier
from pipeline.protocol.links import WorkItem
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from support.loadgen import synthetic_group

SCHEMA = RecordSchema()
SIZE = 4


def _groups(n: int = 5):
    """``n`` groups of `SIZE` samples of several lengths, half starting with their prompt's answer."""
    source = SyntheticPromptSource()
    prompts = [source.load(10 + i) for i in range(n)]
    groups = [synthetic_group(WorkItem(i, 0, p.prompt_id, SIZE, p.token_ids, 0), 0, SCHEMA, 1, 30)
              for i, p in enumerate(prompts)]
    return SampleBatch.concat(groups), prompts


def _expected(batch: SampleBatch, prompts) -> np.ndarray:
    """1 where a sample's completion starts with its group's prompt's last token, else 0."""
    firsts = [int(batch.tokens("completion_ids", i)[0]) for i in range(len(batch))]
    return np.array([float(f == prompts[i // SIZE].answer) for i, f in enumerate(firsts)], np.float32)


def test_a_batch_is_scored_in_one_pass_as_each_group_alone():
    batch, prompts = _groups()
    calls = []
    scorer = VerifierScorer(lambda p, ids: calls.append(1) or last_token_verifier(p, ids))
    scoring = AsyncScoring(scorer)
    scoring.submit_groups([("g", i) for i in range(5)], batch, prompts)
    out = list(scoring.completed())
    want = _expected(batch, prompts)
    assert 0 < want.sum() < len(want) and len(calls) == len(batch)  # each sample verified once
    assert [key for key, *_ in out] == [("g", i) for i in range(5)]
    for i, (_, group, rewards, err) in enumerate(out):
        assert err is None and rewards.dtype == np.float32
        np.testing.assert_array_equal(rewards, want[i * SIZE:(i + 1) * SIZE])
        np.testing.assert_array_equal(group.columns["completion_ids"],
                                      batch.rows(i * SIZE, (i + 1) * SIZE).columns["completion_ids"])
        np.testing.assert_array_equal(scorer.score(group, prompts[i]), rewards)


class _PerGroup(Scorer):
    """Scores group by group (the default `Scorer.score_groups`); fails or answers NaN for one prompt."""

    def __init__(self, bad_prompt: int, how: str):
        self.bad, self.how = bad_prompt, how

    def score(self, group, prompt):
        if prompt.prompt_id == self.bad:
            if self.how == "raise":
                raise RuntimeError("scorer broke")
            return np.full(len(group), np.nan if self.how == "nan" else 1.0,
                           np.float32)[:len(group) - (self.how == "short")]
        return np.array([last_token_verifier(prompt, group.tokens("completion_ids", i))
                         for i in range(len(group))], np.float32)


@pytest.mark.parametrize("how", ["raise", "nan", "short"])
@pytest.mark.parametrize("threads", [0, 1])
def test_a_failure_in_the_batch_is_its_own_groups_only(how, threads):
    batch, prompts = _groups()
    scoring = AsyncScoring(_PerGroup(prompts[2].prompt_id, how), threads=threads)
    try:
        scoring.submit_groups([("g", i) for i in range(5)], batch, prompts)
        out, deadline = [], time.monotonic() + 10
        while len(out) < 5 and time.monotonic() < deadline:  # a pool's groups come when scored
            out += list(scoring.completed())
            time.sleep(0.01 * (len(out) < 5))
    finally:
        scoring.close()
    want = _expected(batch, prompts)
    by_key = {key: (rewards, err) for key, _, rewards, err in out}
    assert sorted(by_key) == [("g", i) for i in range(5)]
    for i in range(5):
        rewards, err = by_key[("g", i)]
        if i == 2:
            assert rewards is None and err is not None
            continue
        assert err is None
        np.testing.assert_array_equal(rewards, want[i * SIZE:(i + 1) * SIZE])


def test_a_row_views_token_count_is_its_rows():
    """`SampleBatch.num_tokens` of a batch and of its row views (read from their offsets) is the
    sum of their prompt and completion lengths."""
    batch, _ = _groups()
    plen, clen = batch.columns["prompt_len"].astype(int), batch.columns["completion_len"].astype(int)
    assert batch.num_tokens == plen.sum() + clen.sum()
    for a, b in [(0, 4), (4, 12), (7, 8), (0, 20), (3, 3)]:
        rows = batch.rows(a, b)
        assert rows.num_tokens == plen[a:b].sum() + clen[a:b].sum()
        assert rows.num_completion_tokens == clen[a:b].sum()
