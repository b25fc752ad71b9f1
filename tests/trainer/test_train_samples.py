"""`train_samples`: the one conversion of a step's SampleBatch into the trainer's samples."""
from __future__ import annotations

import numpy as np

from pipeline.protocol.record import RecordSchema
from pipeline.trainer.layout import train_samples
from support.rollout_data import make_batch


def _slices(lengths: np.ndarray) -> list[slice]:
    ends = np.cumsum(lengths)
    return [slice(int(e - n), int(e)) for e, n in zip(ends, lengths)]


def test_every_field_of_every_sample_comes_from_its_own_rows_of_the_batch():
    """Against the batch's columns cut by hand: ``logprobs`` become the behaviour logprobs, each
    optional per-token column is taken under its name, the routing is the prompt rows followed by
    every completion row but the last; a plain schema leaves the optional fields None."""
    schema = RecordSchema(token_rewards=True, teacher_logprobs=True, routed_experts=(2, 2), sampling_mask_k=3,
                          model_mask=True)
    batch = make_batch(schema, seed=5, n=6)
    cols = batch.columns
    prompts, completions = _slices(cols["prompt_len"]), _slices(cols["completion_len"])
    samples = train_samples(batch)
    assert len(samples) == 6
    for i, s in enumerate(samples):
        p, c = prompts[i], completions[i]
        np.testing.assert_array_equal(s.prompt_ids, cols["prompt_ids"][p])
        np.testing.assert_array_equal(s.completion_ids, cols["completion_ids"][c])
        np.testing.assert_array_equal(s.behaviour_logprobs, cols["logprobs"][c])
        for name in ("sampling_mask", "model_mask", "teacher_logprobs", "token_rewards"):
            np.testing.assert_array_equal(getattr(s, name), cols[name][c], err_msg=name)
        routing = np.concatenate([cols["prompt_routed_experts"][p], cols["routed_experts"][c][:-1]])
        np.testing.assert_array_equal(s.routed_experts, routing)
        assert (s.reward, s.group_id) == (np.float32(cols["reward"][i]), cols["group_id"][i])

    plain = train_samples(make_batch(RecordSchema(), seed=6, n=2))
    assert all(s.sampling_mask is s.model_mask is s.teacher_logprobs is s.token_rewards is s.routed_experts is None
               for s in plain)
