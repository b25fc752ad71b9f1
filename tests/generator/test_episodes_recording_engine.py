"""Episodes record step rewards, kept sets and routing over every turn, on a real vLLM engine (the tiny
MoE in float32, top-k sampling with the sampling mask, routing capture, prefix caching off).

References, independent of the episode loop: the turns as the engine returned them (each
`Generator.complete` call recorded), the environment's known rewards, and transformers' model run
over the whole episode (its top-k set of each model token's position; its routers' experts at every
position). One engine, two episodes of three model turns and one whose budget leaves no room after the first
observation.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest

from support.routing import compare

pytestmark = pytest.mark.engine
WIDTH, TOP_K, TURNS = 8, 4, 3
TIE = 1e-4  # logits this close to the k-th/(k+1)-th boundary may fall either side: left out


def _topk_sets(model_dir, sequence, positions):
    """transformers' top-k ids (as sets) of the next-token distribution at `positions`, and
    whether each position's k-th and (k+1)-th logits are a near-tie."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, positions]
    top = logits.topk(TOP_K + 1, dim=-1)
    ties = (top.values[:, TOP_K - 1] - top.values[:, TOP_K] < TIE).tolist()
    return [set(row[:TOP_K]) for row in top.indices.tolist()], ties


def test_an_episode_records_step_rewards_kept_sets_and_routing_at_the_right_tokens(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.envs import EpisodeConfig
    from pipeline.generator.config import GeneratorConfig, GroupRequest
    from pipeline.generator.engine import Generator
    from pipeline.generator.episodes import EpisodeRunner
    from pipeline.rollout_log.reader import RolloutLog
    from pipeline.protocol.record import RecordSchema, sequence_routing
    from pipeline.protocol.sample_batch import SampleBatch
    from pipeline.rollout_log.writer import RolloutLogWriter
    from support.oracle import sharpened_checkpoint

    model_dir = sharpened_checkpoint("moe", tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    hf = AutoConfig.from_pretrained(str(model_dir))
    schema = RecordSchema(model_mask=True, token_rewards=True, sampling_mask_k=WIDTH,
                          routed_experts=(hf.num_hidden_layers, hf.num_experts_per_tok))
    cfg = GeneratorConfig(model=str(model_dir), max_model_len=512, max_tokens=160, enforce_eager=True,
                          dtype="float32", kv_cache_gib=1, max_num_seqs=8, seed=11, top_k=TOP_K,
                          sampling_mask_width=WIDTH, record_routing=True,
                          stop_token_ids=list(range(0, len(tokenizer), 2)))
    gen = Generator(cfg, schema=schema)
    gen.episodes = EpisodeRunner("support.envs:Rewarding", EpisodeConfig(max_turns=TURNS, step_rewards=True),
                                 tokenizer)
    turns, inner = [], gen.complete

    async def recording(prompt_ids, *a, **kw):
        c = await inner(prompt_ids, *a, **kw)
        turns[-1].append((len(prompt_ids), c))
        return c

    gen.complete = recording
    prompts = [tokenizer(f"<|im_start|>user\n{q}=<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
               for q in ("12*34", "56*78")]

    async def run():
        await gen.start()
        try:
            samples = []
            for g, prompt in enumerate(prompts):
                turns.append([])
                samples.append(await gen.generate_sample(GroupRequest(g, g, 0, prompt, 1), 0))
            turns.append([])  # a budget the observation (15 tokens) cannot fit into with a turn after it
            tight = await gen.episode_or_completion(prompts[0], lambda seg: 5, max_tokens=12)
            return samples, tight
        finally:
            gen.shutdown()

    samples, tight = asyncio.run(run())
    assert tight.finish_reason == "length" and set(tight.model_mask) == {1}  # not appended: no turn follows
    assert len(tight.token_ids) <= 12 and len(turns[-1]) == 1
    for s, prompt, seen in zip(samples, prompts, turns):
        p, c = len(prompt), len(s.completion_ids)
        assert len(seen) == TURNS and all(t.finish_reason == "stop" for _, t in seen)
        assert s.model_mask[-1] == 1 and (s.model_mask == 0).sum() > 0  # ends on a model token
        model_rows = np.flatnonzero(s.model_mask == 1)
        env_rows = np.flatnonzero(s.model_mask == 0)

        # step rewards: the reward of the step after turn k (k + 1.25) at that turn's last token
        expected = np.zeros(c, np.float32)
        for k, (given, turn) in enumerate(seen):
            start = given - p
            assert s.completion_ids[start:start + len(turn.token_ids)].tolist() == turn.token_ids
            expected[start + len(turn.token_ids) - 1] = k + 1.25
        np.testing.assert_array_equal(s.token_rewards, expected)

        # kept sets: each turn's rows as the engine returned them, -1 rows on environment tokens,
        # and on model tokens transformers' top-k set at that position
        assert s.sampling_mask.shape == (c, WIDTH) and (s.sampling_mask[env_rows] == -1).all()
        for given, turn in seen:
            np.testing.assert_array_equal(s.sampling_mask[given - p:given - p + len(turn.token_ids)],
                                          np.concatenate(turn.sampling_mask))
        sequence = prompt + s.completion_ids.tolist()
        want, ties = _topk_sets(model_dir, sequence, (p - 1 + model_rows).tolist())
        got = [set(row[row >= 0].tolist()) for row in s.sampling_mask[model_rows]]
        assert all(t in kept for t, kept in zip(s.completion_ids[model_rows], got))
        differ = [i for i, (a, b, tie) in enumerate(zip(got, want, ties)) if not tie and a != b]
        assert not differ and sum(ties) < len(ties) / 2, (differ, sum(ties))

        # routing: every position the trainer feeds (prompt, every turn, every observation) has the
        # experts transformers routes the whole episode's tokens to; the never-fed last row is -1
        assert (s.routed_experts[-1] == -1).all()
        routed = sequence_routing(s.prompt_routed_experts, s.routed_experts)
        compared, tie_rows, wrong = compare(model_dir, [sequence[:-1]], [routed])
        assert compared > 0 and wrong == 0, (compared, tie_rows, wrong)

    # through the rollout log (journal, sealed HDF5 segment) and back: every field, rewards included
    batch = SampleBatch.from_samples(samples, schema)
    with RolloutLogWriter(tmp_path / "run" / "rollouts", schema, "episodes", {}) as w:
        w.append_samples(batch)
        w.flush()
        w.seal()
    with RolloutLog.open(tmp_path / "run") as log:
        assert log.schema == schema
        back = log.read(np.arange(log.num_samples))
    for name in batch.columns:
        np.testing.assert_array_equal(back.columns[name], batch.columns[name], err_msg=name)
    print(f"\nepisodes of {[len(s.completion_ids) for s in samples]} tokens, "
          f"{[int((s.model_mask == 0).sum()) for s in samples]} environment tokens; rewards at "
          f"{[np.flatnonzero(s.token_rewards).tolist() for s in samples]}")
