"""What a rollout log writer refuses, and which failures mean a full disk.

Invariants: a check raises a `LogError` subclass naming the column or file and the problem, before
anything is buffered or written; `disk_full` looks through the causes of an error (h5py wraps the
OS error of a failed write).

Worked example: ``cast_column("steps.dp_rank", np.array([70000]), np.dtype(np.int16))`` raises
``LogError("steps.dp_rank: values outside the range of int16")``; ``[3]`` becomes ``int16 [3]``.
"""
from __future__ import annotations

import numpy as np

from pipeline.rollout_log.format import FULL_ERRNOS, LogError, SchemaMismatchError
from pipeline.rollout_log.segment import Segment
from pipeline.protocol.record import RecordSchema


def disk_full(e: BaseException | None) -> bool:
    """Whether ``e`` (or what caused it: h5py wraps OS errors) is ENOSPC / EDQUOT."""
    while e is not None:
        if isinstance(e, OSError) and (e.errno in FULL_ERRNOS or "errno = 28" in str(e)
                                       or "No space left" in str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def cast_column(name: str, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` as a contiguous array of the column's ``dtype``, or `LogError` when it does not fit."""
    arr = np.asarray(value)
    if arr.dtype != dtype and arr.size:
        if arr.dtype.kind in "iub" and dtype.kind in "iu":
            info = np.iinfo(dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise LogError(f"{name}: values outside the range of {dtype}")
        elif not np.can_cast(arr.dtype, dtype, casting="same_kind"):
            raise LogError(f"{name}: dtype {arr.dtype} cannot be stored as {dtype}")
    if arr.dtype != dtype:
        arr = arr.astype(dtype)
    return np.ascontiguousarray(arr)


def check_matches(seg: Segment, schema: RecordSchema, run_id: str) -> None:
    """Refuse (`SchemaMismatchError`) to continue a log of another run or record schema."""
    if seg.run_id != run_id:
        raise SchemaMismatchError(f"refusing to write: {seg.path} belongs to run {seg.run_id!r}, "
                                  f"not {run_id!r}")
    if seg.schema != schema:
        raise SchemaMismatchError(
            f"refusing to write: {seg.path} has record schema {seg.schema}, this run's config "
            f"gives {schema}; a config change that changes the file schema needs a new run")
