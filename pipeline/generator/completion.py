"""What the engine hands back for one sample, and its conversions to the rollout record.

`Completion` is the engine's answer (`pipeline.generator.engine`) or a whole multi-turn episode
(`pipeline.generator.episodes`); `rollout_sample` and `eval_sample` are the only places a
`RolloutSample` (`pipeline.protocol.record`, the record on the wire and on disk) is built from one.

Invariants: a rollout sample carries the completion's tokens, behaviour logprobs and per-token
versions unchanged; an evaluation answer is never trained on: its logprobs are 0 and the fields
only training uses are `unrecorded_fields` (rows of -1, rewards 0).

Worked example: a completion ``token_ids=[4, 2], logprobs=[-0.1, -0.5], versions=[3, 3]`` of
group 7, sample 1 becomes ``RolloutSample(group_id=7, sample_index=1, completion_ids=[4, 2],
logprobs=[-0.1, -0.5], versions=[3, 3], ...)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from pipeline.generator.config import GroupRequest
from pipeline.protocol.record import RecordSchema, RolloutSample, unrecorded_fields


@dataclass
class Completion:
    """One finished request (or the concatenation of an abort-resumed sample's segments)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    sampling_mask: list[np.ndarray] | None = None
    """Per segment ``[tokens, width]`` kept ids (``generator.sampling_mask_width`` > 0, sampled requests)."""
    routed_experts: np.ndarray | None = None
    """``[prompt + completion - 1, moe_layers, top_k]`` int16 experts of every position the model ran
    (``generator.record_routing``; the last segment's, which recomputed every earlier position)."""
    model_mask: list[int] | None = None
    """Episodes only: 1 per token the policy sampled, 0 per environment token (pipeline.generator.episodes)."""
    token_rewards: list[float] | None = None
    """Episodes only: per token, the reward of the environment step its model turn ended with, at the
    turn's last token; 0 elsewhere (pipeline.generator.episodes)."""


class EpisodeRunning(Protocol):
    """What the engine runs a multi-turn episode with (`pipeline.generator.episodes.EpisodeRunner`)."""

    async def run(self, gen, prompt_ids: Sequence[int], seed_of_segment: Callable[[int], int | None],
                  budget: int, greedy: bool = False) -> Completion:
        ...


def rollout_sample(c: Completion, request: GroupRequest, sample_index: int, generator_id: int,
                   schema: RecordSchema, t_start: float, t_end: float,
                   routing: dict[str, np.ndarray]) -> RolloutSample:
    """Sample ``sample_index`` of ``request``'s group; ``routing``: its routing fields (or none)."""
    return RolloutSample(
        group_id=request.group_id, sample_index=sample_index, prompt_id=request.prompt_id,
        attempt=request.attempt, prompt_ids=np.asarray(request.prompt_ids, dtype=np.int32),
        completion_ids=np.asarray(c.token_ids, dtype=np.int32),
        logprobs=np.asarray(c.logprobs, dtype=np.float32), versions=np.asarray(c.versions, dtype=np.int32),
        finish_reason=c.finish_reason, generator_id=generator_id, t_start=t_start,
        t_end=t_end, schema=schema,
        sampling_mask=np.concatenate(c.sampling_mask) if schema.sampling_mask_k else None,
        model_mask=np.asarray(c.model_mask, np.uint8) if schema.model_mask else None,
        token_rewards=np.asarray(c.token_rewards, np.float32) if schema.token_rewards else None,
        **routing)


def eval_sample(c: Completion, index: int, prompt_ids: np.ndarray, generator_id: int,
                schema: RecordSchema, sample_index: int = 0) -> RolloutSample:
    """Answer ``sample_index`` to evaluation prompt ``index`` (0: the greedy one; 1..k: sampled ones;
    ``c`` holds at least one token)."""
    n = len(c.token_ids)
    return RolloutSample(
        group_id=0, sample_index=sample_index, prompt_id=index, attempt=0, prompt_ids=prompt_ids,
        completion_ids=np.asarray(c.token_ids, np.int32), logprobs=np.zeros(n, np.float32),
        versions=np.asarray(c.versions, np.int32), finish_reason=c.finish_reason,
        generator_id=generator_id, schema=schema,
        model_mask=np.asarray(c.model_mask or [1] * n, np.uint8) if schema.model_mask else None,
        **unrecorded_fields(schema, len(prompt_ids), n))
