"""Deterministic synthetic SampleBatches for the rollout log tests (well-formed, seed-determined)."""
from __future__ import annotations

import numpy as np

from pipeline.protocol.record import FINISH_REASONS, RecordSchema
from pipeline.protocol.record_schema import SCALAR_COLUMNS
from pipeline.protocol.sample_batch import SampleBatch


def make_batch(schema: RecordSchema, seed: int, n: int, first_group: int = 0, group_size: int = 4,
               version: int = 0, prompt_len: tuple[int, int] = (1, 20),
               completion_len: tuple[int, int] = (1, 50), reward: float | None = None) -> SampleBatch:
    """``n`` samples of groups ``first_group, first_group + 1, ...`` (``group_size`` each); all
    values derive from ``seed``; versions are ``version`` or ``version + 1`` (never decreasing)."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(prompt_len[0], prompt_len[1] + 1, n).astype(np.int32)
    clen = rng.integers(completion_len[0], completion_len[1] + 1, n).astype(np.int32)
    total = int(clen.sum())
    cols = {
        "group_id": first_group + np.arange(n) // group_size, "sample_index": np.arange(n) % group_size,
        "prompt_id": rng.integers(0, 1000, n), "attempt": rng.integers(0, 3, n),
        "finish_reason": rng.integers(0, len(FINISH_REASONS), n),
        "reward": rng.random(n) if reward is None else np.full(n, reward),
        "generator_id": rng.integers(0, 8, n), "t_start": rng.random(n) * 1e9,
        "t_end": rng.random(n) * 1e9, "prompt_len": plen, "completion_len": clen,
    }
    cols = {k: np.asarray(v).astype(SCALAR_COLUMNS[k]) for k, v in cols.items()}
    if "teacher_version" in schema.scalar_columns():
        cols["teacher_version"] = rng.integers(-1, 100, n).astype(np.int32)
    cols["prompt_ids"] = rng.integers(0, 50_000, int(plen.sum())).astype(np.int32)
    for name, (dtype, trail) in schema.prompt_token_fields().items():  # prompt_routed_experts
        cols[name] = rng.integers(0, 64, (int(plen.sum()), *trail)).astype(dtype)
    # versions: `version` up to a random switch point (>= 1) of each completion, then version + 1
    pos = np.arange(total) - np.repeat(np.cumsum(clen) - clen, clen)
    versions = version + (pos >= np.repeat(rng.integers(1, clen + 1), clen))
    for name, (dtype, trail) in schema.token_fields().items():
        shape = (total, *trail)
        if name in ("completion_ids",):
            cols[name] = rng.integers(0, 50_000, shape).astype(dtype)
        elif name == "versions":
            cols[name] = versions.astype(dtype)
        elif name in ("logprobs", "teacher_logprobs"):
            cols[name] = (-rng.exponential(1.0, shape)).astype(dtype)
        elif name == "model_mask":  # episodes: each completion starts with a model token
            cols[name] = (rng.random(total) < 0.7).astype(dtype)
            cols[name][np.cumsum(clen) - clen] = 1
        elif name == "token_rewards":
            cols[name] = rng.standard_normal(shape).astype(dtype)
        else:  # routed_experts, sampling_mask
            cols[name] = rng.integers(-1 if name == "sampling_mask" else 0, 64, shape).astype(dtype)
    return SampleBatch(cols, schema, validate=True)


def assert_batches_equal(a: SampleBatch, b: SampleBatch) -> None:
    assert a.schema == b.schema
    assert set(a.columns) == set(b.columns)
    for k in a.columns:
        x, y = a.columns[k], b.columns[k]
        assert x.dtype == y.dtype, k
        np.testing.assert_array_equal(x, y, err_msg=k)
