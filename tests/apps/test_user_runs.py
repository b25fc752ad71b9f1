"""Short `tokenflow train` runs as users make them (real vLLM generator, real megatron trainer):

- the demo with pass@k (``eval.samples=4``) and every tracker (``logger=[tensorboard,wandb,mlflow]``):
  W&B's offline run file and MLflow's file store hold every step's reward; pass@k and greedy
  accuracy equal a count made here from the per-prompt answers (completion ids decoded and scored by
  the task, not by the orchestrator); `tokenflow compare` and TensorBoard show them;
- verl's GSM8K Parquet layout with nothing but ``task.path`` (no warm-start: the tiny model answers
  badly, the point is that the data trains and is evaluated by held-out set and data source).

Cost: the demo run ~60 s on 2 cores (its warm-start is cached); the Parquet run (slow-marked) ~60 s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.metrics import read_metrics

pytestmark = pytest.mark.engine

COMMON = ["run.steps=2", "run.eval_every=2", "run.checkpoint_every=2", "run.mismatch_every=0", "run.timeout_s=300",
          "run.progress=false", "orchestrator.groups_per_step=2", "orchestrator.group_size=4"]


def train(run_dir: Path, *overrides: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pipeline.cli", "train", f"run.name={run_dir.name}", f"hydra.run.dir={run_dir}",
           *COMMON, *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, f"train failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("users") / "demo"
    train(run, "eval.samples=4", "eval.temperature=1.0", "logger=[tensorboard,wandb,mlflow]")
    return run


def test_pass_at_k_equals_a_count_of_the_recorded_answers(demo):
    from transformers import AutoTokenizer

    from pipeline.run_dir import model_dir
    from pipeline.tasks import TaskConfig, make_task

    tokenizer = AutoTokenizer.from_pretrained(model_dir(demo))
    task = make_task(TaskConfig())
    prompts = task.eval_prompts()
    answers = [json.loads(line) for line in (demo / "eval" / "answers.jsonl").read_text().splitlines()]
    evals = {e["step"]: e for e in read_metrics(demo, "eval")}
    assert 2 in evals  # the final round (the first is replaced when step 2 asks before it ends)
    for step, record in evals.items():
        mine = {a["index"]: a for a in answers if a["step"] == step}
        assert sorted(mine) == list(range(len(prompts))) == list(range(record["n"]))
        greedy, passed, sampled = [], [], []
        for i, a in mine.items():
            scores = [task.score(prompts[i], tokenizer.decode(ids, skip_special_tokens=True))
                      for ids in a["completion_ids"]]
            assert len(scores) == 5 and scores == [a["greedy"], *a["samples"]]
            greedy.append(scores[0])
            passed.append(max(scores[1:]) == 1.0)
            sampled.append(np.mean(scores[1:]))
        assert record["k"] == 4 and record["accuracy"] == pytest.approx(np.mean(greedy))
        assert record["pass_at_k"] == pytest.approx(np.mean(passed))
        assert record["sampled_accuracy"] == pytest.approx(np.mean(sampled))
    assert evals[2]["pass_at_k"] >= evals[2]["accuracy"] - 0.1  # sampling 4 times rarely loses to greedy


def test_trackers_and_compare_show_every_step(demo, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when told
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from test_trackers import wandb_history

    rewards = {s["step"]: s["reward_mean"] for s in read_metrics(demo, "train_step")}
    assert sorted(rewards) == [0, 1]
    history = wandb_history(demo)
    assert {r["trainer_step"]: r["train_step/reward_mean"] for r in history if "train_step/reward_mean" in r} \
        == pytest.approx(rewards)
    final = [e for e in read_metrics(demo, "eval") if e["step"] == 2][0]
    assert [r["eval/pass_at_k"] for r in history if r.get("trainer_step") == 2 and "eval/pass_at_k" in r] \
        == [pytest.approx(final["pass_at_k"])]
    client = MlflowClient(tracking_uri=(demo / "trackers" / "mlflow").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("tokenflow").experiment_id])
    got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train_step/reward_mean")}
    assert got == pytest.approx(rewards)
    assert run.data.params["eval.samples"] == "4"
    tb = EventAccumulator(str(demo / "tensorboard"))
    tb.Reload()
    assert [e.value for e in tb.Scalars("eval/pass_at_k")][-1] == pytest.approx(final["pass_at_k"])
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "compare", str(demo), "--json"],
                         capture_output=True, text=True, timeout=120)
    (row,) = json.loads(out.stdout)["runs"]
    assert row["final_pass_at_k"] == pytest.approx(final["pass_at_k"]) and row["eval_k"] == 4
    assert (demo / "training.png").exists()


@pytest.mark.slow
def test_verl_parquet_trains_with_nothing_but_its_path(tmp_path):
    """~60 s (one 2-step run without warm-start); the formats themselves are checked without engines
    in tests/tasks/test_user_datasets.py."""
    from test_user_datasets import write_gsm8k_parquet

    data = write_gsm8k_parquet(tmp_path / "gsm8k.parquet")
    run = tmp_path / "gsm8k"
    # The budgets only keep the run short (the tiny model would otherwise get 256 + 768: defaults.py).
    train(run, "task=dataset", f"task.path={data}", "model.warmstart_steps=0", "logger=[]",
          "task.max_tokens=24", "task.max_prompt_tokens=96")
    steps = list(read_metrics(run, "train_step"))
    assert [s["step"] for s in steps] == [0, 1] and all(np.isfinite(s["reward_mean"]) for s in steps)
    evals = list(read_metrics(run, "eval"))
    assert [e["n"] for e in evals] == [40, 40]
    assert all(e["n/heldout"] == 40 and e["n/source/openai/gsm8k"] == 40 for e in evals)
    by_source = [r["reward_mean/source/openai/gsm8k"] for r in read_metrics(run, "orchestrator")
                 if "reward_mean/source/openai/gsm8k" in r]
    assert by_source and all(0.0 <= r <= 1.0 for r in by_source)
    (dataset,) = read_metrics(run, "dataset")
    assert (dataset["train_rows"], dataset["eval_prompts"], dataset["bad_rows"]) == (160, 40, 0)
