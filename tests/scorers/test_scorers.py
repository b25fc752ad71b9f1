"""Scorer roles: reward-model and process-reward scores against transformers, and the scorer
pool's behaviour when a scorer stalls, answers late, or is killed (real processes, real ZeroMQ,
real HDF5 log; the generator and trainer are `tests/support/loadgen.py` processes)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import RunConfig, TokenflowConfig, stored_record_schema
from pipeline.rollout_log.format import GroupOutcome
from pipeline.rollout_log.reader import RolloutLog
from pipeline.metrics import read_metrics
from pipeline.orchestrator.config import OrchestratorConfig
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.run_dir import save_run_config
from pipeline.scorers.config import ScorersConfig
from pipeline.scorers.models import ProcessRewardScorer, RewardModelScorer, step_ends
from pipeline.tasks import TaskConfig
from support.child_env import child_env
from support.reward_model import build_tiny_reward_model

PY = sys.executable
LOADGEN = str(Path(__file__).parents[1] / "support" / "loadgen.py")


def hf_score(model, ids) -> float:
    """transformers' own score of one unpadded sequence (the independent reference)."""
    with torch.no_grad():
        return float(model(input_ids=torch.as_tensor(np.asarray(ids, np.int64))[None]).logits[0, 0])


def batch_of(prompts, completions) -> SampleBatch:
    n = len(prompts)
    clen = np.array([len(c) for c in completions], np.int32)
    cols = {"group_id": np.zeros(n, np.int64), "sample_index": np.arange(n, dtype=np.int32),
            "prompt_id": np.zeros(n, np.int64), "attempt": np.zeros(n, np.int32),
            "finish_reason": np.zeros(n, np.uint8), "reward": np.full(n, np.nan, np.float32),
            "generator_id": np.zeros(n, np.int32), "t_start": np.zeros(n), "t_end": np.zeros(n),
            "prompt_len": np.array([len(p) for p in prompts], np.int32), "completion_len": clen,
            "prompt_ids": np.concatenate(prompts).astype(np.int32),
            "completion_ids": np.concatenate(completions).astype(np.int32),
            "logprobs": np.full(clen.sum(), -1.0, np.float32), "versions": np.zeros(clen.sum(), np.int32)}
    return SampleBatch(cols, RecordSchema())


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", vocab_size=1024)


def test_reward_and_process_scores_equal_transformers(tiny_rm):
    from transformers import AutoModelForSequenceClassification

    ref = AutoModelForSequenceClassification.from_pretrained(str(tiny_rm), dtype=torch.float32).eval()
    rng = np.random.default_rng(3)
    step = 7
    prompts = [rng.integers(1, 1000, n) for n in (3, 11, 6, 20, 4)]
    completions = [rng.integers(1, 1000, n) for n in (9, 2, 15, 5, 12)]
    completions[0][[2, 5]] = step
    completions[2][[0, 14]] = step  # a step token as the last token ends the last step once
    batch = batch_of(prompts, completions)

    rewards = RewardModelScorer(tiny_rm)(batch)["reward"]
    expected = [hf_score(ref, np.r_[p, c]) for p, c in zip(prompts, completions)]
    np.testing.assert_allclose(rewards, expected, rtol=1e-5, atol=1e-5)
    assert np.ptp(rewards) > 0.05, "scores must differ between samples for the check to mean anything"

    out = ProcessRewardScorer(tiny_rm, step_token_id=step)(batch)
    offsets = np.r_[0, np.cumsum([len(c) for c in completions])]
    for i, (p, c) in enumerate(zip(prompts, completions)):
        tr = out["token_rewards"][offsets[i]:offsets[i + 1]]
        ends = step_ends(c, step)
        want = [hf_score(ref, np.r_[p, c[:e + 1]]) for e in ends]
        np.testing.assert_allclose(tr[ends], want, rtol=1e-5, atol=1e-5)
        assert (np.delete(tr, ends) == 0).all()
        assert out["reward"][i] == pytest.approx(min(want), abs=1e-5)
    assert list(step_ends(completions[0], step)) == [2, 5, 8]
    assert list(step_ends(completions[2], step)) == [0, 14]


def _start(args, log: Path) -> subprocess.Popen:
    return subprocess.Popen([PY, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=child_env(OMP_NUM_THREADS="1"))


def _scorer(run_dir: Path, rank: int, tag: str) -> subprocess.Popen:
    return _start(["-m", "pipeline.scorers.role", str(run_dir), "--service", "reward", f"--rank={rank}"],
                  run_dir / f"scorer{tag}.log")


def _metric(run_dir: Path, key: str) -> float:
    m = list(read_metrics(run_dir, "orchestrator"))
    return m[-1].get(key, 0) if m else 0


def _wait(cond, what: str, timeout: float = 60.0, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


STEPS = 30


def test_stalled_late_and_killed_scorers_cost_no_group_and_score_once(tmp_path, tiny_rm):
    """Scorer A is stopped past the request timeout (its groups go to B), resumed (its late
    answers are ignored as duplicates), stopped again holding requests and killed with SIGKILL.
    Every group is stored once, with the reward the reward model gives it, and none is lost to
    scoring."""
    from transformers import AutoModelForSequenceClassification

    run = tmp_path / "run"
    run.mkdir()
    scfg = ScorersConfig(reward="reward_model", reward_model=str(tiny_rm), reward_scorers=2,
                         batch_groups=2, timeout_s=4.0, dead_after_s=120.0, max_attempts=8)
    cfg = TokenflowConfig(run=RunConfig(name="t", dir=str(run)), task=TaskConfig(name="synthetic", eval_size=4),
                          orchestrator=OrchestratorConfig(group_size=4, groups_per_step=4, max_async=1,
                                                          metrics_interval_s=0.2, lease_timeout_s=60.0),
                          scorers=scfg)
    save_run_config(run, cfg)
    schema = json.dumps(stored_record_schema(cfg).to_dict())
    procs = [_start(["-m", "pipeline.apps.orchestrator", str(run)], run / "orch.log")]
    try:
        _wait(lambda: (run / "rendezvous" / "scorers.json").exists(), "the scorer pool", procs=procs)
        # A joins first, so the pool offers each request to A before B (it dispatches in joining order):
        # a stopped A is then always sent work that times out (with B first, B could take every request
        # while A stood stopped, and no timeout came: a CI failure)
        a = _scorer(run, 0, "a")
        procs.append(a)
        _wait(lambda: _metric(run, "scorers_live_reward") == 1, "scorer A", procs=procs)
        b = _scorer(run, 1, "b")
        procs += [b, _start([LOADGEN, "generator", str(run), "--id=0", "--duration=300", "--max-len=40"],
                            run / "gen.log")]
        _wait(lambda: _metric(run, "scorers_live_reward") == 2, "two scorers", procs=procs)
        # enough steps that groups still need scoring after the second stall, however fast the first
        # part went (with 10 the trainer could be done before the stopped scorer was sent anything)
        trainer = _start([LOADGEN, "trainer", str(run), f"--steps={STEPS}", "--dp-size=1", "--step-time=0.5",
                          "--timeout=90", f"--schema={schema}"], run / "trainer.log")
        _wait(lambda: _metric(run, "scorer_requests") >= 4, "scoring under way", procs=procs)
        a.send_signal(signal.SIGSTOP)  # stalled past timeout_s: its requests go to B
        _wait(lambda: _metric(run, "scorer_timeouts") >= 1, "a request timeout", procs=procs)
        a.send_signal(signal.SIGCONT)  # answers late: the pool must keep the first answers only
        _wait(lambda: _metric(run, "scorer_duplicate") >= 1, "a late duplicate answer", procs=procs)
        a.send_signal(signal.SIGSTOP)  # again, until a request it holds times out: then kill it
        _wait(lambda: _metric(run, "scorer_timeouts") >= 2, "a second request timeout", procs=procs)
        a.kill()
        a.wait()
        procs.remove(a)
        # (its task supervisor would restart it: tests/scorers/test_teacher_engine.py covers that path)
        assert trainer.wait(timeout=240) == 0, (run / "trainer.log").read_text()[-2000:]
        resent = _metric(run, "scorer_resent_groups")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in procs:
            p.wait(timeout=30)
    assert resent >= 2  # the stalled scorer's groups, then the killed one's
    assert _metric(run, "count_score_error") == 0
    ref = AutoModelForSequenceClassification.from_pretrained(str(tiny_rm), dtype=torch.float32).eval()
    with RolloutLog.open(run / "rollouts") as log:
        g = log.groups()
        stored = g["group_id"][g["outcome"] == GroupOutcome.STORED]
        assert len(stored) >= STEPS * 4 and len(stored) == len(np.unique(stored)), "a group stored twice"
        assert not (g["outcome"] == GroupOutcome.DROPPED_INVALID).any()
        batch = SampleBatch.concat(list(log.iter_batches()))
    assert sorted(np.unique(batch.columns["group_id"]).tolist()) == sorted(stored.tolist())
    expected = [hf_score(ref, np.r_[batch.prompt(i), batch.tokens("completion_ids", i)])
                for i in range(len(batch))]
    np.testing.assert_allclose(batch.columns["reward"], expected, rtol=1e-4, atol=1e-4)


def test_inspect_shows_token_rewards_teacher_versions_and_kl(tmp_path, capsys):
    from pipeline.apps.inspect_log import main
    from pipeline.rollout_log.writer import RolloutLogWriter
    from support.rollout_data import make_batch

    schema = RecordSchema(token_rewards=True, teacher_logprobs=True)
    parts = [make_batch(schema, s, 8, first_group=2 * s, version=s) for s in (1, 2)]
    for b in parts:  # a step reward on some tokens only, as process rewards leave them
        b.columns["token_rewards"][::3] = 0.0
    with RolloutLogWriter(tmp_path / "rollouts", schema, "t", {"group_size": 4}) as w:
        for b in parts:
            w.append_samples(b)
    data = SampleBatch.concat(parts)
    assert main([str(tmp_path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["scorers"]
    tr = data.columns["token_rewards"]
    assert s["token_rewards"]["rewarded_tokens"] == int((tr != 0).sum())
    assert s["token_rewards"]["mean"] == pytest.approx(float(tr[tr != 0].mean()), rel=1e-5)
    tv = data.columns["teacher_version"]
    assert s["teacher"]["samples_by_teacher_version"] == {str(v): int((tv == v).sum()) for v in np.unique(tv)}
    for version in (1, 2):  # make_batch: oldest token version = the batch's version
        b = parts[version - 1]
        kl = float((b.columns["logprobs"] - b.columns["teacher_logprobs"]).astype(np.float64).mean())
        assert s["teacher"]["reverse_kl_by_version"][str(version)] == pytest.approx(kl, rel=1e-5)
    assert main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "samples by teacher version" in text and "reverse KL to the teacher" in text


def test_plan_has_scorer_and_teacher_components_only_when_used(tmp_path):
    from pipeline.apps.train import job_plan
    from pipeline.config import validate

    cfg = TokenflowConfig(run=RunConfig(name="t", dir=str(tmp_path)))
    assert list(job_plan(cfg, tmp_path).components) == ["trainer", "generator"]
    cfg.scorers = ScorersConfig(reward="process_reward", reward_model="/rm", step_token_id=3,
                                reward_scorers=2, teacher="lagged", teacher_lag=2)
    plan = job_plan(cfg, tmp_path)
    assert list(plan.components) == ["trainer", "generator", "scorer", "teacher"]
    assert plan.components["scorer"].num_tasks == 2 and plan.components["teacher"].num_tasks == 1
    assert plan.components["teacher"].entry == "pipeline.scorers.role:main"
    plan.validate()
    s = stored_record_schema(cfg)
    assert s.token_rewards and s.teacher_logprobs and "teacher_version" in s.scalar_columns()
    cfg.scorers.step_token_id = -1
    with pytest.raises(ValueError, match="step_token_id"):
        cfg.scorers.validate()
    cfg.scorers = ScorersConfig(teacher="frozen")
    with pytest.raises(ValueError, match="teacher_model"):
        validate(cfg)


def test_lagged_teacher_version_window():
    from pipeline.scorers.pool import lagged_teacher_version

    for lag in (1, 2, 3):
        for every in (1, 2, 5):
            for v in range(lag, 40):
                t = lagged_teacher_version(v, lag, every)
                assert v - lag - every + 1 <= t <= v - lag and t % every == 0
            assert all(lagged_teacher_version(v, lag, every) == 0 for v in range(lag))
