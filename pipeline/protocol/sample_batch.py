"""`SampleBatch`: N rollout samples (`pipeline.protocol.record.RolloutSample`) as flat columns, the
form a batch crosses the network in and lands on disk in.

Invariants: a batch's columns are exactly its `RecordSchema`'s (every scalar column, ``prompt_ids``,
every per-prompt-token and per-token field it enables) with their dtypes and shapes, and their values
keep the sample invariants of `pipeline.protocol.record` (`check_layout`, `check_values`; a batch
built from validated samples or rows of a validated batch is not checked again).

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

from typing import Iterator, Mapping, Sequence

import numpy as np

from pipeline.protocol.record import FINISH_REASONS, RolloutSample, check_model_mask, check_token_values
from pipeline.protocol.record_schema import PROMPT_COLUMN, RecordError, RecordSchema


class SampleBatch:
    """N samples as flat columns (see the module docstring for the layout).

    ``columns`` maps every scalar column, ``prompt_ids`` and every per-token field of ``schema``
    to a numpy array. Arrays may be read-only views of network frames or HDF5 reads.
    """

    __slots__ = ("columns", "schema", "_offs")

    def __init__(self, columns: Mapping[str, np.ndarray], schema: RecordSchema,
                 validate: bool = True):
        self.columns = dict(columns)
        self.schema = schema
        if validate:
            self.validate()
        self._offs: tuple[np.ndarray, np.ndarray] | None = None  # counted when first needed

    @property
    def _p_off(self) -> np.ndarray:
        """Where each row's prompt tokens start (and the end): ``N + 1`` offsets."""
        return (self._offs or self._count_offsets())[0]

    @property
    def _c_off(self) -> np.ndarray:
        """Where each row's completion tokens start (and the end): ``N + 1`` offsets."""
        return (self._offs or self._count_offsets())[1]

    def _count_offsets(self) -> tuple[np.ndarray, np.ndarray]:
        self._offs = (_offsets(self.columns["prompt_len"]), _offsets(self.columns["completion_len"]))
        return self._offs

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
        """Check the value bounds of every column (`pipeline.protocol.record` invariants) of a batch whose layout
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
        """Prompt plus completion tokens of all samples (the offsets' ends once counted: a row view's are)."""
        if self._offs is not None:
            return int(self._offs[0][-1]) + int(self._offs[1][-1])
        return int(self.columns["prompt_len"].sum() + self.columns["completion_len"].sum())

    @property
    def num_completion_tokens(self) -> int:
        if self._offs is not None:
            return int(self._offs[1][-1])
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

    def groups(self, n: int) -> list["SampleBatch"]:
        """The batch as ``n`` consecutive groups of ``len(self) // n`` rows each, as `rows` views."""
        size = len(self) // n
        return [self.rows(i * size, (i + 1) * size) for i in range(n)]

    def with_column(self, name: str, values: np.ndarray) -> "SampleBatch":
        """This batch with the scalar column ``name`` (not a length) replaced by ``values``, of
        the same rows (not validated)."""
        if name in ("prompt_len", "completion_len") or name not in self.schema.scalar_columns():
            raise RecordError(f"{name} is not a scalar column that can be replaced")
        return self._derived({**self.columns, name: values}, self._p_off, self._c_off)

    def _derived(self, columns: dict[str, np.ndarray], p_off: np.ndarray, c_off: np.ndarray) -> "SampleBatch":
        """A batch of ``columns`` whose offsets are known (no validation, no recount)."""
        out = SampleBatch.__new__(SampleBatch)
        out.columns, out.schema, out._offs = columns, self.schema, (p_off, c_off)
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
