"""The rollout record: one sample of a prompt group, and its columnar batch form (which fields a run
records, and their dtypes: `pipeline.protocol.record_schema`).

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

`SampleBatch` is the same data for N samples as flat columns: one array per scalar field (length N)
and ragged per-token fields concatenated with per-sample lengths. Worked example, two samples with
prompts of 3 and 2 tokens and completions of 2 and 4 tokens::

    prompt_len     = [3, 2]            prompt_ids     = [p0 p1 p2 | q0 q1]          (5 = 3 + 2)
    completion_len = [2, 4]            completion_ids = [a0 a1 | b0 b1 b2 b3]       (6 = 2 + 4)
                                       logprobs, versions: same offsets as completion_ids

Row i's completion is ``completion_ids[c_off[i] : c_off[i] + completion_len[i]]`` with
``c_off = [0, 2]``. This layout is shared by the wire codec and the HDF5 log, so a batch crosses
the network and lands on disk without per-sample conversion.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

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


class SampleBatch:
    """N samples as flat columns (see the module docstring for the layout).

    ``columns`` maps every scalar column, ``prompt_ids`` and every per-token field of ``schema``
    to a numpy array. Arrays may be read-only views of network frames or HDF5 reads.
    """

    __slots__ = ("columns", "schema", "_p_off", "_c_off")

    def __init__(self, columns: Mapping[str, np.ndarray], schema: RecordSchema,
                 validate: bool = True):
        self.columns = dict(columns)
        self.schema = schema
        if validate:
            self.validate()
        self._p_off = _offsets(self.columns["prompt_len"])
        self._c_off = _offsets(self.columns["completion_len"])

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_samples(cls, samples: Sequence[RolloutSample], schema: RecordSchema) -> "SampleBatch":
        cols: dict[str, np.ndarray] = {}
        for name, dtype in schema.scalar_columns().items():
            if name == "finish_reason":
                vals = [FINISH_REASONS.index(s.finish_reason) for s in samples]
            elif name == "prompt_len":
                vals = [len(s.prompt_ids) for s in samples]
            elif name == "completion_len":
                vals = [len(s.completion_ids) for s in samples]
            else:
                vals = [getattr(s, name) for s in samples]
            cols[name] = np.asarray(vals, dtype=dtype)
        cols["prompt_ids"] = _concat([s.prompt_ids for s in samples], PROMPT_COLUMN[1], ())
        for name, (dtype, trail) in schema.prompt_token_fields().items():
            cols[name] = _concat([getattr(s, name) for s in samples], dtype, trail)
        for name, (dtype, trail) in schema.token_fields().items():
            for s in samples:
                if s.schema != schema:
                    raise RecordError(f"sample of group {s.group_id} was built for another schema")
            cols[name] = _concat([getattr(s, name) for s in samples], dtype, trail)
        return cls(cols, schema, validate=False)

    @classmethod
    def empty(cls, schema: RecordSchema) -> "SampleBatch":
        return cls.from_samples([], schema)

    @classmethod
    def concat(cls, batches: Sequence["SampleBatch"]) -> "SampleBatch":
        if not batches:
            raise RecordError("cannot concatenate zero batches")
        schema = batches[0].schema
        if any(b.schema != schema for b in batches):
            raise RecordError("cannot concatenate batches of different record schemas")
        cols = {k: np.concatenate([b.columns[k] for b in batches]) for k in batches[0].columns}
        return cls(cols, schema, validate=False)

    # -- checks -----------------------------------------------------------------------------
    def column_names(self) -> list[str]:
        return (list(self.schema.scalar_columns()) + [PROMPT_COLUMN[0]] + list(self.schema.prompt_token_fields())
                + list(self.schema.token_fields()))

    def validate(self) -> None:
        """Check dtypes, shapes, lengths and value bounds of every column (vectorised)."""
        self.check_layout()
        self.check_values()

    def check_layout(self) -> None:
        """Check the columns' names, dtypes, shapes and lengths (not their values): a batch of
        several such batches concatenated passes `check_values` iff each of them would."""
        expected = set(self.column_names())
        got = set(self.columns)
        if got != expected:
            missing, extra = sorted(expected - got), sorted(got - expected)
            raise RecordError(f"batch columns differ from the schema: missing {missing}, extra {extra}")
        n = len(self.columns["group_id"])
        for name, dtype in self.schema.scalar_columns().items():
            a = self.columns[name]
            if a.dtype != dtype or a.shape != (n,):
                raise RecordError(f"column {name}: expected {dtype}[{n}], got {a.dtype}{list(a.shape)}")
        plen, clen = self.columns["prompt_len"], self.columns["completion_len"]
        total_p, total_c = int(plen.sum()), int(clen.sum())
        a = self.columns["prompt_ids"]
        if a.dtype != PROMPT_COLUMN[1] or a.shape != (total_p,):
            raise RecordError(f"column prompt_ids: expected int32[{total_p}], got {a.dtype}{list(a.shape)}")
        for name, (dtype, trail) in self.schema.prompt_token_fields().items():
            a = self.columns[name]
            if a.dtype != dtype or a.shape != (total_p, *trail):
                raise RecordError(f"column {name}: expected {dtype}{[total_p, *trail]}, "
                                  f"got {a.dtype}{list(a.shape)}")
        for name, (dtype, trail) in self.schema.token_fields().items():
            a = self.columns[name]
            if a.dtype != dtype or a.shape != (total_c, *trail):
                raise RecordError(f"column {name}: expected {dtype}{[total_c, *trail]}, "
                                  f"got {a.dtype}{list(a.shape)}")

    def check_values(self) -> None:
        """Check the value bounds of every column (module invariants) of a batch whose layout
        `check_layout` accepted."""
        c = self.columns
        plen, clen = c["prompt_len"], c["completion_len"]
        if len(plen):  # python min() over a few rows beats numpy's per-call overhead here
            if min(plen.tolist() + clen.tolist()) < 1:
                raise RecordError("a sample has an empty prompt or completion")
            for name in ("group_id", "sample_index", "prompt_id", "attempt", "generator_id"):
                if min(c[name].tolist()) < 0:
                    raise RecordError(f"column {name} holds a negative id")
            if max(c["finish_reason"].tolist()) >= len(FINISH_REASONS):
                raise RecordError("column finish_reason holds an unknown code")
        check_token_values(c["prompt_ids"], c["completion_ids"], c["logprobs"], c["versions"], clen)
        if self.schema.model_mask and len(plen):
            check_model_mask(c["model_mask"], clen)

    # -- access -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.columns["group_id"])

    @property
    def num_tokens(self) -> int:
        """Prompt plus completion tokens of all samples."""
        return int(self.columns["prompt_len"].sum() + self.columns["completion_len"].sum())

    @property
    def num_completion_tokens(self) -> int:
        return int(self.columns["completion_len"].sum())

    def min_versions(self) -> np.ndarray:
        """Oldest token version of each sample (versions never decrease, so the first token's)."""
        return self.columns["versions"][self._c_off[:-1]] if len(self) else np.zeros(0, np.int32)

    def take(self, rows: Sequence[int] | np.ndarray) -> "SampleBatch":
        """A new batch holding the given rows, in the given order."""
        rows = np.asarray(rows, dtype=np.int64)
        cols = {name: self.columns[name][rows] for name in self.schema.scalar_columns()}
        cols["prompt_ids"] = _gather(self.columns["prompt_ids"], self._p_off, rows)
        for name in self.schema.prompt_token_fields():
            cols[name] = _gather(self.columns[name], self._p_off, rows)
        for name in self.schema.token_fields():
            cols[name] = _gather(self.columns[name], self._c_off, rows)
        return SampleBatch(cols, self.schema, validate=False)

    def rows(self, start: int, stop: int) -> "SampleBatch":
        """Rows ``start``..``stop - 1`` as views of this batch's arrays (no copy)."""
        p0, p1 = int(self._p_off[start]), int(self._p_off[stop])
        c0, c1 = int(self._c_off[start]), int(self._c_off[stop])
        cols = {name: self.columns[name][start:stop] for name in self.schema.scalar_columns()}
        for name in (PROMPT_COLUMN[0], *self.schema.prompt_token_fields()):
            cols[name] = self.columns[name][p0:p1]
        for name in self.schema.token_fields():
            cols[name] = self.columns[name][c0:c1]
        return self._derived(cols, self._p_off[start:stop + 1] - p0, self._c_off[start:stop + 1] - c0)

    def with_column(self, name: str, values: np.ndarray) -> "SampleBatch":
        """This batch with the scalar column ``name`` (not a length) replaced by ``values``, of
        the same rows (not validated)."""
        if name in ("prompt_len", "completion_len") or name not in self.schema.scalar_columns():
            raise RecordError(f"{name} is not a scalar column that can be replaced")
        return self._derived({**self.columns, name: values}, self._p_off, self._c_off)

    def _derived(self, columns: dict[str, np.ndarray], p_off: np.ndarray, c_off: np.ndarray) -> "SampleBatch":
        """A batch of ``columns`` whose offsets are known (no validation, no recount)."""
        out = SampleBatch.__new__(SampleBatch)
        out.columns, out.schema, out._p_off, out._c_off = columns, self.schema, p_off, c_off
        return out

    def prompt(self, i: int, name: str = "prompt_ids") -> np.ndarray:
        """Row i's per-prompt-token ``name`` (the prompt's ids by default)."""
        return self.columns[name][self._p_off[i]:self._p_off[i + 1]]

    def tokens(self, name: str, i: int) -> np.ndarray:
        return self.columns[name][self._c_off[i]:self._c_off[i + 1]]

    def sample(self, i: int) -> RolloutSample:
        c = self.columns
        kw = {name: self.tokens(name, i) for name in self.schema.token_fields()}
        if "teacher_version" in c:
            kw["teacher_version"] = int(c["teacher_version"][i])
        kw.update({name: self.prompt(i, name) for name in self.schema.prompt_token_fields()})
        return RolloutSample(
            group_id=int(c["group_id"][i]), sample_index=int(c["sample_index"][i]),
            prompt_id=int(c["prompt_id"][i]), attempt=int(c["attempt"][i]),
            prompt_ids=self.prompt(i), finish_reason=FINISH_REASONS[int(c["finish_reason"][i])],
            reward=float(c["reward"][i]), generator_id=int(c["generator_id"][i]),
            t_start=float(c["t_start"][i]), t_end=float(c["t_end"][i]), schema=self.schema, **kw)

    def __iter__(self) -> Iterator[RolloutSample]:
        return (self.sample(i) for i in range(len(self)))


def _offsets(lengths: np.ndarray) -> np.ndarray:
    off = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=off[1:])
    return off


def _concat(arrays: list[np.ndarray], dtype: np.dtype, trail: tuple[int, ...]) -> np.ndarray:
    if not arrays:
        return np.zeros((0, *trail), dtype=dtype)
    return np.concatenate(arrays).astype(dtype, copy=False)


def _gather(flat: np.ndarray, off: np.ndarray, rows: np.ndarray) -> np.ndarray:
    if len(rows) == 0:
        return flat[:0].copy()
    starts, ends = off[rows], off[rows + 1]
    lens = ends - starts
    # Index of every element to take: for each row, starts[r] .. ends[r]-1.
    idx = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens) + np.arange(lens.sum())
    return flat[idx]
