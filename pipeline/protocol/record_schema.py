"""The record's schema: which fields a run records, their dtypes, and the error every record check raises.

Invariants this module keeps:

- a run's `RecordSchema` is fixed by its config for the run's whole life; the rollout log stores
  it (``to_dict``) and a resumed run or a reader gets it back unchanged (``from_dict``), refusing
  unknown fields with `RecordError` naming them;
- every sample has the scalar columns `SCALAR_COLUMNS` (plus ``teacher_version`` with teacher
  logprobs), the ragged prompt column `PROMPT_COLUMN`, the three per-completion-token fields
  ``completion_ids``, ``logprobs``, ``versions``, and exactly the optional per-token fields the
  schema enables (`RecordSchema.token_fields`, `RecordSchema.prompt_token_fields`).

Example: ``RecordSchema(routed_experts=(2, 4), sampling_mask_k=8)`` adds ``routed_experts``
(int16, trailing shape (2, 4): 2 MoE layers x top-4 per token), ``sampling_mask`` (int32, (8,))
and ``prompt_routed_experts`` (int16, (2, 4) per prompt token). `pipeline.protocol.record` checks samples
and batches against it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Mapping

import numpy as np


class RecordError(ValueError):
    """A rollout record (or batch of them) violates the record's invariants."""


@dataclass(frozen=True)
class RecordSchema:
    """Which optional per-token fields a run records. Fixed by the run's config for its whole life."""

    token_rewards: bool = False
    """A float32 reward per completion token, besides the scalar reward: each step's reward at the
    token that ends it, 0 elsewhere (process rewards, `pipeline.scorers.models`; an episode's
    environment step rewards at the last token of each model turn, `pipeline.generator.episodes`)."""
    teacher_logprobs: bool = False
    """A float32 teacher logprob per completion token (on-policy distillation)."""
    routed_experts: tuple[int, int] | None = None
    """(moe_layers, top_k): the experts each prompt and completion token was routed to at generation
    (Keep Routing); enables ``routed_experts`` (per completion token) and ``prompt_routed_experts``."""
    sampling_mask_k: int | None = None
    """Width k of the per-token list of token ids the sampler kept (top-k/top-p), padded with -1."""
    model_mask: bool = False
    """A uint8 per completion token: 1 = sampled by the policy, 0 = an environment observation
    (multi-turn episodes; the trainer's loss and corrections skip the 0s)."""

    def token_fields(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """Per-completion-token fields of this schema: name -> (dtype, trailing shape)."""
        return dict(_token_fields(self))  # a copy: the caller may change it

    def prompt_token_fields(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """Optional per-prompt-token fields of this schema: name -> (dtype, trailing shape)."""
        if self.routed_experts is None:
            return {}
        return {"prompt_routed_experts": (np.dtype(np.int16), tuple(self.routed_experts))}

    def scalar_columns(self) -> dict[str, np.dtype]:
        """Scalar (per-sample) columns of this schema: `SCALAR_COLUMNS`, plus ``teacher_version``
        with teacher logprobs."""
        if not self.teacher_logprobs:
            return SCALAR_COLUMNS
        return {**SCALAR_COLUMNS, "teacher_version": np.dtype(np.int32)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_rewards": self.token_rewards,
            "teacher_logprobs": self.teacher_logprobs,
            "routed_experts": list(self.routed_experts) if self.routed_experts else None,
            "sampling_mask_k": self.sampling_mask_k,
            "model_mask": self.model_mask,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RecordSchema":
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise RecordError(f"record schema has unknown fields {sorted(unknown)}")
        re = d.get("routed_experts")
        return cls(
            token_rewards=bool(d.get("token_rewards", False)),
            teacher_logprobs=bool(d.get("teacher_logprobs", False)),
            routed_experts=(int(re[0]), int(re[1])) if re else None,
            sampling_mask_k=None if d.get("sampling_mask_k") is None else int(d["sampling_mask_k"]),
            model_mask=bool(d.get("model_mask", False)),
        )


#: Scalar (one value per sample) columns of a SampleBatch and their dtypes.
SCALAR_COLUMNS: dict[str, np.dtype] = {
    "group_id": np.dtype(np.int64),
    "sample_index": np.dtype(np.int32),
    "prompt_id": np.dtype(np.int64),
    "attempt": np.dtype(np.int32),
    "finish_reason": np.dtype(np.uint8),
    "reward": np.dtype(np.float32),
    "generator_id": np.dtype(np.int32),
    "t_start": np.dtype(np.float64),
    "t_end": np.dtype(np.float64),
    "prompt_len": np.dtype(np.int32),
    "completion_len": np.dtype(np.int32),
}
#: The ragged prompt column (per prompt token).
PROMPT_COLUMN = ("prompt_ids", np.dtype(np.int32))


@lru_cache(maxsize=64)
def _token_fields(schema: RecordSchema) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """`RecordSchema.token_fields`, built once per schema."""
    out: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
        "completion_ids": (np.dtype(np.int32), ()),
        "logprobs": (np.dtype(np.float32), ()),
        "versions": (np.dtype(np.int32), ()),
    }
    if schema.token_rewards:
        out["token_rewards"] = (np.dtype(np.float32), ())
    if schema.teacher_logprobs:
        out["teacher_logprobs"] = (np.dtype(np.float32), ())
    if schema.routed_experts is not None:
        out["routed_experts"] = (np.dtype(np.int16), tuple(schema.routed_experts))
    if schema.sampling_mask_k is not None:
        out["sampling_mask"] = (np.dtype(np.int32), (int(schema.sampling_mask_k),))
    if schema.model_mask:
        out["model_mask"] = (np.dtype(np.uint8), ())
    return out
