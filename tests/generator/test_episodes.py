"""Multi-turn episodes without an engine: the record's model mask, environments under timeouts, the
tool task, masked losses, and the inspect view (engine tests: tests/generator/test_episodes_engine.py)."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from pipeline.envs import CalculatorEnv, Environment, EnvironmentError_, Step, step_with_timeout
from pipeline.envs.calculator import evaluate, tool_turn
from pipeline.protocol.record import RecordError, RecordSchema, RolloutSample
from pipeline.protocol.sample_batch import SampleBatch

EPISODES = RecordSchema(model_mask=True)


def _episode(mask, versions=None, logprobs=None, **kw) -> RolloutSample:
    n = len(mask)
    return RolloutSample(
        group_id=kw.get("group_id", 1), sample_index=kw.get("sample_index", 0), prompt_id=3, attempt=0,
        prompt_ids=np.array([5, 6, 7]), completion_ids=np.arange(10, 10 + n),
        logprobs=np.where(np.asarray(mask) == 1, -0.5, 0.0) if logprobs is None else logprobs,
        versions=np.zeros(n, np.int32) if versions is None else versions, finish_reason="stop",
        model_mask=np.asarray(mask, np.uint8), schema=EPISODES)


def test_model_mask_is_an_additive_schema_field_checked_on_samples_and_batches():
    s = _episode([1, 1, 0, 0, 1], versions=[2, 2, 2, 2, 3])
    b = SampleBatch.from_samples([s, _episode([1, 0, 1], group_id=2)], EPISODES)
    b.validate()
    assert b.tokens("model_mask", 0).tolist() == [1, 1, 0, 0, 1] and b.min_versions().tolist() == [2, 0]
    assert RecordSchema.from_dict(EPISODES.to_dict()) == EPISODES
    assert RecordSchema.from_dict({k: v for k, v in RecordSchema().to_dict().items()
                                   if k != "model_mask"}) == RecordSchema()  # logs from before episodes
    with pytest.raises(RecordError, match="starts with an environment token"):
        _episode([0, 1, 1])
    with pytest.raises(RecordError, match="other than 0 and 1"):
        _episode([1, 2, 1])
    with pytest.raises(RecordError, match="required by the run's record schema"):
        RolloutSample(group_id=0, sample_index=0, prompt_id=0, attempt=0, prompt_ids=[1],
                      completion_ids=[2], logprobs=[-1.0], versions=[0], finish_reason="stop", schema=EPISODES)
    with pytest.raises(RecordError, match="versions decrease"):  # env tokens follow the version rule too
        _episode([1, 0, 1], versions=[3, 2, 3])
    bad = dict(b.columns)
    bad["model_mask"] = np.array([1, 1, 0, 0, 1, 0, 0, 1], np.uint8)  # second episode starts with env
    with pytest.raises(RecordError, match="starts with an environment token"):
        SampleBatch(bad, EPISODES)
    assert _episode([1, 0], logprobs=np.array([-1.0, 0.0])).finish_reason == "stop"


def test_calculator_grammar_and_observation():
    assert [evaluate(e) for e in ("37*48", "2+3*4", "10 - 2*3 + 1", "2**9", "(2+3)", "-5", "1/2")] == \
        [1776, 14, 5, None, None, None, None]
    env = CalculatorEnv()
    assert env.step("calc 37*48") == Step(tool_turn("=1776"), 0.0, False)
    assert env.step(" calc 2**9 ") == Step(tool_turn("=error"), 0.0, False)
    assert env.step("1776").done


class _Hangs(Environment):
    def __init__(self):
        self.release = threading.Event()

    def step(self, message):
        self.release.wait(30)
        return Step("late", 0.0, True)


class _Raises(Environment):
    def step(self, message):
        raise KeyError("tool backend down")


def test_a_hung_or_failing_step_raises_environment_error_within_its_timeout():
    async def scenario():
        hung = _Hangs()
        t0 = time.monotonic()
        with pytest.raises(EnvironmentError_, match="longer than 0.2 s"):
            await step_with_timeout(hung, "x", 0.2)
        waited = time.monotonic() - t0
        hung.release.set()  # the abandoned thread finishes later; nothing waits for it any more
        with pytest.raises(EnvironmentError_, match="tool backend down"):
            await step_with_timeout(_Raises(), "x", 5)
        assert (await step_with_timeout(CalculatorEnv(), "calc 2*3", 5)).observation == tool_turn("=6")
        return waited

    assert asyncio.run(scenario()) < 20  # returned on the timeout, not when the step ended (30 s)


def test_toolcalc_task_reference_episode_scores_and_splits():
    from pipeline.tasks import TaskConfig, make_task, task_environment

    cfg = TaskConfig(name="toolcalc")
    task = make_task(cfg)
    assert task_environment(cfg) == "calculator" and task_environment(TaskConfig()) is None
    evals = task.eval_prompts()
    assert len({p.uid for p in evals}) == 200
    held = {p.text for p in evals}
    train = [task.prompt_by_id(0, i) for i in range(500)]
    assert not held & {p.text for p in train}
    assert train[7] == task.prompt_by_id(0, 7)
    p = evals[0]
    a, b = map(int, p.text[:-1].split("*"))
    assert p.answer == str(a * b)
    # the transcript as the verifier sees it: decoded without special tokens
    transcript = f"calc {a}*{b}\ntool\n={a * b}\nassistant\n{a * b}"
    assert task.score(p, transcript) == 1.0 and task.score(p, str(a * b)) == 1.0
    assert task.score(p, f"calc {a}*{b}\ntool\n={a * b}") == 0.0  # the tool's line is not the answer
    assert task.score(p, task.distractor_completion(p)) == 0.0
    ref = task.reference_completion(p)
    assert ref.startswith(f"calc {a}*{b}<|im_end|>") and ref.endswith(f"assistant\n{a * b}")


def test_environment_tokens_get_no_gradient_and_the_loss_is_over_model_tokens_only():
    """The layout masks env tokens; the loss and its gradient equal a hand computation over the
    model tokens alone (an independent reference), whatever the env positions' logprobs are."""
    import torch

    from pipeline.trainer.config import LossConfig
    from pipeline.trainer.layout import PaddedLayout, TrainSample
    from pipeline.trainer.loss import policy_loss

    mask = np.array([1, 1, 0, 0, 0, 1])
    behaviour = np.array([-1.0, -2.0, 0.0, 0.0, 0.0, -0.5], np.float32)
    sample = TrainSample(prompt_ids=np.array([1, 2, 3]), completion_ids=np.array([4, 5, 6, 7, 8, 9]),
                         behaviour_logprobs=behaviour, advantage=1.5, model_mask=mask)
    (mb,) = PaddedLayout(1024).micro_batches([sample])
    assert mb.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1]  # positions P-1 .. P+C-2
    assert sample.trained.sum() == 3
    logp = torch.tensor([[-3.0, -3.0, -1.2, -1.9, -9.0, -7.0, -8.0, -0.4]], requires_grad=True)
    cfg = LossConfig()
    loss, metrics = policy_loss(logp, mb.extras["behaviour"], mb.extras["advantage"], mb.loss_mask, 3, cfg)
    loss.backward()
    assert logp.grad[0, [0, 1, 4, 5, 6]].abs().max() == 0  # prompt and environment positions
    assert (logp.grad[0, [2, 3, 7]] != 0).all()
    # reference: token_tis with ratio 1 (prox = logp) -> loss_t = -min(w, cap) * A over model tokens
    model_logp, model_beh = np.array([-1.2, -1.9, -0.4]), behaviour[mask == 1]
    w = np.minimum(np.exp(model_logp - model_beh), cfg.tis_cap)
    assert float(loss.detach()) == pytest.approx(float((-w * 1.5).sum() / 3), rel=1e-6)
    assert float(metrics["tokens"]) == 3


def test_inspect_turns_worked_example():
    from pipeline.apps.inspect_episodes import describe, turns

    assert turns(np.array([1, 1, 1, 0, 0, 1, 1])) == [(0, 3, True), (3, 5, False), (5, 7, True)]
    b = SampleBatch.from_samples([_episode([1, 1, 1, 0, 0, 1, 1], versions=[3, 3, 3, 3, 3, 4, 4])], EPISODES)
    d = describe(b, 0)
    assert [(t["role"], t["tokens"], t["versions"]) for t in d["turns"]] == \
        [("model", 3, [3, 3]), ("env", 2, [3, 3]), ("model", 2, [4, 4])]


def test_episode_config_is_validated_and_step_rewards_enable_token_rewards():
    """Episodes record the model mask; ``episode.step_rewards`` adds ``token_rewards`` to what the
    generators send and the log stores; it needs an environment and no scorer roles (which would
    drop the generators' token rewards); evaluation answers carry zero rewards."""
    from pipeline.config import TokenflowConfig, record_schema, stored_record_schema, validate
    from pipeline.envs import EpisodeConfig
    from pipeline.protocol.record import unrecorded_fields

    with pytest.raises(ValueError, match="episode.step_timeout_s"):
        EpisodeConfig(step_timeout_s=0).validate()
    cfg = TokenflowConfig()
    cfg.task.name = "toolcalc"
    assert record_schema(cfg).model_mask and not record_schema(TokenflowConfig()).model_mask
    assert not record_schema(cfg).token_rewards
    cfg.episode.step_rewards = True
    assert record_schema(cfg).token_rewards and stored_record_schema(cfg).token_rewards
    validate(cfg)
    assert unrecorded_fields(record_schema(cfg), 3, 4)["token_rewards"].tolist() == [0.0] * 4
    cfg.scorers.teacher, cfg.scorers.teacher_model = "frozen", "/teacher"
    with pytest.raises(ValueError, match="scorer roles"):
        validate(cfg)
    plain = TokenflowConfig()
    plain.episode.step_rewards = True
    with pytest.raises(ValueError, match="needs a task with an environment"):
        validate(plain)
    plain.episode.environment = "support.envs:Echo"  # any task's prompts become episodes
    validate(plain)
    assert record_schema(plain).model_mask and record_schema(plain).token_rewards
    plain.episode.environment = "support.envs:NoSuchEnv"
    with pytest.raises(ValueError, match="episode.environment: environment 'support.envs:NoSuchEnv' cannot be"):
        validate(plain)


def test_step_rewards_must_be_finite_numbers():
    class Bad(Environment):
        def __init__(self, reward):
            self.reward = reward

        def step(self, message):
            return Step("", self.reward, True)

    async def scenario():
        assert (await step_with_timeout(Bad(np.float32(0.5)), "x", 5)).reward == 0.5
        for reward in (float("nan"), "1"):
            with pytest.raises(EnvironmentError_, match="not a finite number"):
                await step_with_timeout(Bad(reward), "x", 5)

    asyncio.run(scenario())


def test_episode_records_round_trip_through_the_log_exactly_once_and_inspect_shows_them(tmp_path, capsys):
    """Episodes written through the rollout log's writer (journal, then a sealed segment) read back
    exactly once with their masks, and `tokenflow inspect --json` counts their turns and tool calls
    from the stored masks (reference: the same counts from the samples written)."""
    from pipeline.apps.inspect_log import main as inspect_main
    from pipeline.rollout_log.reader import RolloutLog
    from pipeline.rollout_log.writer import RolloutLogWriter

    masks = [[1, 1, 0, 0, 1], [1, 1, 1], [1, 0, 1, 0, 0, 1, 1], [1, 0, 1]]
    samples = [_episode(m, versions=[4] * (len(m) - 1) + [5], group_id=10 + i // 2, sample_index=i % 2)
               for i, m in enumerate(masks)]
    batch = SampleBatch.from_samples(samples, EPISODES)
    with RolloutLogWriter(tmp_path / "rollouts", EPISODES, "episodes", {}) as w:
        w.append_samples(batch.take([0, 1]))
        w.flush()
        w.seal()
        w.append_samples(batch.take([2, 3]))
        w.flush()
    with RolloutLog.open(tmp_path) as log:
        assert log.schema == EPISODES
        got = log.read(np.arange(log.num_samples))
    assert got.columns["group_id"].tolist() == [10, 10, 11, 11]  # each once, in order
    for name in batch.columns:
        np.testing.assert_array_equal(got.columns[name], batch.columns[name], err_msg=name)
    assert inspect_main([str(tmp_path), "--json", "--episodes", "2"]) == 0
    import json

    e = json.loads(capsys.readouterr().out)["episodes"]
    env_turns = [sum(1 for a, b in zip([1] + m, m) if a == 1 and b == 0) for m in masks]
    assert e["episodes"] == 4 and e["tool_calls"] == sum(env_turns) == 4
    assert e["model_turns"] == {"1": 1, "2": 2, "3": 1}
    assert e["env_tokens_masked"] == sum(m.count(0) for m in masks)
    assert e["spanning_versions"] == 4 and len(e["examples"]) == 2
    assert [t["role"] for t in e["examples"][-1]["turns"]] == ["model", "env", "model"]
    assert inspect_main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "tool calls    4;" in text and "  env      1 tokens  v4" in text
