"""The teacher role on a real vLLM engine: a lagged teacher that is no member of a weight group (the
trainer here pushes no weights), so it follows the policy's checkpoints, its fallback for versions
it never received; killed with SIGKILL mid-run and restarted in place by its task supervisor. Every group is stored
once, with teacher logprobs equal to transformers' under the snapshot recorded as its
``teacher_version``, and that version lies in the lag window across refreshes."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import RunConfig, TokenflowConfig, stored_record_schema
from pipeline.launch.plan import ComponentSpec, JobPlan
from pipeline.rollout_log.format import GroupOutcome
from pipeline.rollout_log.reader import RolloutLog
from pipeline.metrics import read_metrics
from pipeline.orchestrator.config import OrchestratorConfig
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.run_dir import save_run_config
from pipeline.run_files import PLAN_FILE
from pipeline.scorers.config import ScorersConfig
from pipeline.scorers.pool import lagged_teacher_version
from pipeline.tasks import TaskConfig
from support.child_env import child_env

pytestmark = pytest.mark.engine
PY = sys.executable
LOADGEN = str(Path(__file__).parents[1] / "support" / "loadgen.py")
LAG, EVERY, STEPS = 1, 2, 8


def _snapshots(model_dir: Path, run: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Policy snapshots of versions 2, 4, 6 written as the trainer writes checkpoints (HF names,
    ``model-r00000.safetensors``, COMPLETE last); version 0 is the checkpoint itself."""
    from safetensors.torch import load_file, save_file

    base = load_file(str(model_dir / "model.safetensors"))
    out = {0: base}
    for v in range(EVERY, STEPS, EVERY):
        g = torch.Generator().manual_seed(v)
        snap = {k: (t + 0.05 * torch.randn(t.shape, generator=g) * t.float().std()).contiguous()
                for k, t in base.items()}
        d = run / "checkpoints" / f"step-{v}"
        d.mkdir(parents=True)
        save_file(snap, str(d / "model-r00000.safetensors"))
        (d / "COMPLETE").write_text(str(v))
        out[v] = snap
    return out


def _hf_logprobs(model_dir: Path, weights: dict, prompt: np.ndarray, completion: np.ndarray) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    ids = torch.as_tensor(np.r_[prompt, completion].astype(np.int64))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return logp[pos, ids[0, len(prompt):]].numpy()


def _metric(run: Path, key: str) -> float:
    m = list(read_metrics(run, "orchestrator"))
    return m[-1].get(key, 0) if m else 0


def _wait(cond, what: str, timeout: float, procs) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _role_pids(run: Path) -> list[int]:
    log = run / "logs" / "teacher.0.out"
    return [int(p) for p in re.findall(r"--- teacher\.0 role process pid (\d+)", log.read_text())] \
        if log.exists() else []


@pytest.mark.slow  # about 2 min on 2 cores (112 s measured): TOKENFLOW_SLOW=1 runs it
def test_lagged_teacher_killed_and_restarted_keeps_every_group_and_the_version_window(tmp_path):
    from pipeline.models.tiny import TinyModelSpec, ensure_tiny_model

    model = ensure_tiny_model(spec=TinyModelSpec(vocab_size=1024))  # synthetic token ids < 1000
    run = tmp_path / "run"
    run.mkdir()
    snaps = _snapshots(model, run)
    cfg = TokenflowConfig(run=RunConfig(name="t", dir=str(run), checkpoint_every=EVERY),
                          task=TaskConfig(name="synthetic", eval_size=4),
                          orchestrator=OrchestratorConfig(group_size=4, groups_per_step=4, max_async=1,
                                                          metrics_interval_s=0.2, lease_timeout_s=300.0),
                          scorers=ScorersConfig(teacher="lagged", teacher_model=str(model), teacher_lag=LAG,
                                                batch_groups=2, timeout_s=60.0, dead_after_s=30.0))
    save_run_config(run, cfg)
    plan = JobPlan(components={"teacher": ComponentSpec(entry="pipeline.scorers.role:main", max_restarts=2)},
                   config={"run_dir": str(run)})
    (run / PLAN_FILE).parent.mkdir(parents=True, exist_ok=True)
    (run / PLAN_FILE).write_text(plan.to_json())
    schema = json.dumps(stored_record_schema(cfg).to_dict())
    start = lambda args, name: subprocess.Popen([PY, *args], stdout=open(run / name, "w"),  # noqa: E731
                                                stderr=subprocess.STDOUT, env=child_env(OMP_NUM_THREADS="1"))
    procs = [start(["-m", "pipeline.apps.orchestrator", str(run)], "orch.log")]
    try:
        _wait(lambda: (run / "rendezvous" / "scorers.json").exists(), "the scorer pool", 60, procs)
        procs.append(subprocess.Popen([PY, "-m", "pipeline.apps.launch_task", str(run), "0"],
                                      env=child_env(OMP_NUM_THREADS="1", TOKENFLOW_GLOBAL_RANK="0"), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT))
        procs.append(start([LOADGEN, "generator", str(run), "--id=0", "--duration=600", "--min-len=4",
                            "--max-len=24"], "gen.log"))
        _wait(lambda: _metric(run, "scorers_live_teacher") == 1, "the teacher engine", 240, procs)
        trainer = start([LOADGEN, "trainer", str(run), f"--steps={STEPS}", "--dp-size=1", "--step-time=2.0",
                         "--timeout=300", f"--schema={schema}"], "trainer.log")
        _wait(lambda: _metric(run, "scored_samples_teacher") >= 24, "teacher answers", 240, procs)
        first = _role_pids(run)[-1]
        os.kill(first, signal.SIGSTOP)  # it stops answering while the pool keeps sending it work
        time.sleep(3.0)
        os.kill(first, signal.SIGKILL)  # its engine core is orphaned: the supervisor ends it
        _wait(lambda: len(_role_pids(run)) >= 2, "the supervisor's restart", 60, procs)
        assert trainer.wait(timeout=400) == 0, (run / "trainer.log").read_text()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait(timeout=60)
    assert _metric(run, "count_score_error") == 0
    assert _metric(run, "scorer_resent_groups") >= 1  # the killed teacher held requests
    with RolloutLog.open(run / "rollouts") as log:
        g = log.groups()
        stored = g["group_id"][g["outcome"] == GroupOutcome.STORED]
        assert len(stored) == len(np.unique(stored)), "a group was stored twice"
        batch = SampleBatch.concat(list(log.iter_batches()))
        consumed_at = {int(r): tv for _, tv, rows in log.step_records() for r in rows}
        rows = log.rows()
    tv = batch.columns["teacher_version"]
    used = sorted(set(tv.tolist()))
    assert len(used) >= 3 and set(used) <= {0, 2, 4, 6}, used  # refreshed at least twice
    for i in range(len(batch)):
        t = int(tv[i])
        newest_token = int(batch.tokens("versions", i).max())
        # scored at policy version v in [newest token's version, the step that consumed it]
        assert t >= newest_token - LAG - EVERY + 1, (i, t, newest_token)
        if int(rows[i]) in consumed_at:
            v_max = consumed_at[int(rows[i])]
            assert t == lagged_teacher_version(0, LAG, EVERY) or t <= v_max - LAG, (i, t, v_max)
    checked = 0
    for version in used:  # teacher logprobs are the recorded snapshot's, as transformers computes them
        for i in np.flatnonzero(tv == version)[:2]:
            ref = _hf_logprobs(model, snaps[version], batch.prompt(i), batch.tokens("completion_ids", i))
            np.testing.assert_allclose(batch.tokens("teacher_logprobs", i), ref, atol=2e-3)
            checked += 1
    assert checked >= 6
