"""The rollout record: one sample of a prompt group (which fields a run records, and their dtypes:
`pipeline.protocol.record_schema`), and the value checks it shares with its columnar batch form
(`pipeline.protocol.sample_batch`).

Invariants this module keeps (checked on construction, raising `RecordError` naming the field):

- every per-token array of a sample has exactly one entry per completion token: ``logprobs``,
  ``versions`` and each optional per-token field the run's `RecordSchema` enables; every
  per-prompt-token array (`RecordSchema.prompt_token_fields`) one entry per prompt token;
- routing (``routed_experts`` with ``prompt_routed_experts``) is per token AS AN INPUT of the
  model: prompt token i's row holds the experts it was routed to, completion token t's likewise;
  the last completion token is never fed to the model, so its row is all -1. The trainer replays
  the ``P + C - 1`` rows before it (`sequence_routing`);
- ``versions`` (the policy version that produced each token) are non-negative and never decrease
  along a completion (weights only move forward while a sequence is generated);
- token ids are non-negative, behaviour logprobs are finite and ``<= LOGPROB_MAX``;
- episodes (multi-turn tool use, `pipeline.generator.episodes`): with ``RecordSchema.model_mask`` a
  completion is the concatenation of model turns and environment observations; ``model_mask`` is 1
  on tokens the policy sampled and 0 on environment tokens, holds only 0/1, and a completion starts
  with a model token (so its first token's version is its oldest model token's, the one staleness
  counts). Environment tokens carry logprob 0 and the version of the model token before them, so
  the version rule above holds unchanged along an episode; with the sampling mask they carry a row
  of -1 (no kept set), with ``token_rewards`` (environment step rewards) 0: a step's reward sits
  at the last token of the model turn it answered;
- an optional per-token field is present if and only if the schema enables it, so every sample of a
  run has the same fields (the HDF5 log creates every enabled dataset up front: SWMR forbids new
  datasets later).

The columnar form of N samples is `pipeline.protocol.sample_batch.SampleBatch`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.protocol.record_schema import PROMPT_COLUMN, RecordError, RecordSchema

#: Behaviour logprobs must be <= this (0 up to float32 rounding of the engine's log-softmax).
LOGPROB_MAX = 1e-3

#: Finish reasons, stored as their index (uint8).
#: "env_error": an episode whose environment failed or hung (its tokens up to there are kept).
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "env_error")


def _as(name: str, value: Any, dtype: np.dtype, ndim: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype != dtype:
        if arr.size and not np.can_cast(arr.dtype, dtype, casting="same_kind"):
            raise RecordError(f"{name}: dtype {arr.dtype} cannot be stored as {dtype}")
        arr = arr.astype(dtype)
    if arr.ndim != ndim:
        raise RecordError(f"{name}: expected {ndim}-d array, got shape {arr.shape}")
    return arr


@dataclass
class RolloutSample:
    """One completion of a prompt group, with everything the trainer and the log need."""

    group_id: int
    """Admission-ordered id of the prompt group (unique within a run)."""
    sample_index: int
    """Index of this sample within its group, 0..G-1."""
    prompt_id: int
    """Id of the prompt in the run's prompt source."""
    attempt: int
    """How many times the group was issued before this one (a lease that timed out is re-issued)."""
    prompt_ids: np.ndarray
    """int32 prompt token ids as tokenized once by the orchestrator."""
    completion_ids: np.ndarray
    """int32 generated token ids (EOS included when generation stopped on it)."""
    logprobs: np.ndarray
    """float32 behaviour logprob of each completion token under the policy that sampled it."""
    versions: np.ndarray
    """int32 policy version that produced each completion token."""
    finish_reason: str
    """One of FINISH_REASONS."""
    reward: float = math.nan
    """Scalar reward; NaN until scored."""
    generator_id: int = 0
    """Which generator produced the sample."""
    t_start: float = 0.0
    """Wall-clock time (unix seconds) the request started."""
    t_end: float = 0.0
    """Wall-clock time (unix seconds) the request finished."""
    token_rewards: np.ndarray | None = None
    teacher_logprobs: np.ndarray | None = None
    teacher_version: int = -1
    """Policy version of the teacher snapshot that gave ``teacher_logprobs`` (lagged
    self-distillation); -1 for a frozen teacher. Stored only with teacher logprobs."""
    routed_experts: np.ndarray | None = None
    sampling_mask: np.ndarray | None = None
    model_mask: np.ndarray | None = None
    prompt_routed_experts: np.ndarray | None = None
    """int16 [P, moe_layers, top_k]: the experts each prompt token was routed to (with routed_experts)."""
    schema: RecordSchema = field(default_factory=RecordSchema, repr=False)
    """The run's schema, which decides which optional fields must be present."""

    def __post_init__(self) -> None:
        for name in ("group_id", "sample_index", "prompt_id", "attempt", "generator_id"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 0:
                raise RecordError(f"{name} must be a non-negative integer, got {v!r}")
            setattr(self, name, int(v))
        if self.finish_reason not in FINISH_REASONS:
            raise RecordError(f"finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        self.prompt_ids = _as("prompt_ids", self.prompt_ids, PROMPT_COLUMN[1], 1)
        if len(self.prompt_ids) == 0:
            raise RecordError("prompt_ids is empty")
        n = None
        for name, (dtype, trail) in self.schema.token_fields().items():
            arr = getattr(self, name)
            if arr is None:
                raise RecordError(f"{name} is required by the run's record schema but missing")
            arr = _as(name, arr, dtype, 1 + len(trail))
            if arr.shape[1:] != trail:
                raise RecordError(f"{name}: per-token shape {arr.shape[1:]} != schema's {trail}")
            if n is None:
                n = len(arr)
            elif len(arr) != n:
                raise RecordError(f"{name} has {len(arr)} entries for {n} completion tokens")
            setattr(self, name, arr)
        for name, (dtype, trail) in self.schema.prompt_token_fields().items():
            arr = getattr(self, name)
            if arr is None:
                raise RecordError(f"{name} is required by the run's record schema but missing")
            arr = _as(name, arr, dtype, 1 + len(trail))
            if arr.shape != (len(self.prompt_ids), *trail):
                raise RecordError(f"{name}: shape {arr.shape} != ({len(self.prompt_ids)}, *{trail}) "
                                  "(one row per prompt token)")
            setattr(self, name, arr)
        enabled = {**self.schema.token_fields(), **self.schema.prompt_token_fields()}
        for name in ("token_rewards", "teacher_logprobs", "routed_experts", "sampling_mask", "model_mask",
                     "prompt_routed_experts"):
            if name not in enabled and getattr(self, name) is not None:
                raise RecordError(f"{name} is given but the run's record schema does not enable it")
        if n == 0:
            raise RecordError("completion is empty")
        self.reward = float(self.reward)
        self.t_start, self.t_end = float(self.t_start), float(self.t_end)
        check_token_values(self.prompt_ids, self.completion_ids, self.logprobs, self.versions,
                           np.array([n]))
        if self.model_mask is not None:
            check_model_mask(self.model_mask, np.array([n]))

    @property
    def min_version(self) -> int:
        return int(self.versions[0])


def unrecorded_fields(schema: RecordSchema, prompt_len: int, completion_len: int) -> dict[str, np.ndarray]:
    """Routing, sampling-mask and (episodes' step rewards) token-reward fields for a sample the
    trainer never sees (an evaluation answer) when the schema requires them: rows of -1 and
    rewards of 0, nothing recorded."""
    shapes = {**{k: (prompt_len, v) for k, v in schema.prompt_token_fields().items()},
              **{k: (completion_len, v) for k, v in schema.token_fields().items()
                 if k in ("routed_experts", "sampling_mask")}}
    out = {k: np.full((n, *trail), -1, dtype) for k, (n, (dtype, trail)) in shapes.items()}
    if schema.token_rewards:
        out["token_rewards"] = np.zeros(completion_len, np.float32)
    return out


def sequence_routing(prompt_routed: np.ndarray, completion_routed: np.ndarray) -> np.ndarray:
    """``[P + C - 1, layers, k]``: the routing of every position the trainer feeds the model
    (prompt rows, then every completion row but the last, which is never fed)."""
    return np.concatenate([prompt_routed, completion_routed[:-1]])


def check_token_values(prompt_ids: np.ndarray, completion_ids: np.ndarray, logprobs: np.ndarray,
                       versions: np.ndarray, completion_len: np.ndarray) -> None:
    """Vectorised bounds checks shared by single samples and batches (see module invariants)."""
    if prompt_ids.size and prompt_ids.min() < 0:
        raise RecordError("prompt_ids holds a negative token id")
    if completion_ids.size and completion_ids.min() < 0:
        raise RecordError("completion_ids holds a negative token id")
    if logprobs.size:
        if not np.isfinite(logprobs).all():
            raise RecordError("logprobs holds NaN or infinite values")
        if logprobs.max() > LOGPROB_MAX:
            raise RecordError(f"logprobs holds a positive value {float(logprobs.max()):.4g}")
    if versions.size:
        if versions.min() < 0:
            raise RecordError("versions holds a negative policy version")
        # Non-decreasing within each sample: a decrease is only allowed where a new sample starts.
        drops = np.flatnonzero(np.diff(versions) < 0) + 1
        if drops.size:
            starts = np.cumsum(completion_len)[:-1]
            if not np.isin(drops, starts).all():
                raise RecordError("versions decrease within a completion")


def check_model_mask(model_mask: np.ndarray, completion_len: np.ndarray) -> None:
    """Episode masks: only 0/1, and every completion starts with a model token (module invariants)."""
    if model_mask.size and model_mask.max() > 1:
        raise RecordError("model_mask holds a value other than 0 and 1")
    starts = np.concatenate(([0], np.cumsum(completion_len)[:-1])).astype(np.int64)
    if model_mask.size and not model_mask[starts].all():
        raise RecordError("model_mask: a completion starts with an environment token (0)")
