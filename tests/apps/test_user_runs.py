"""Short `tokenflow train` runs as users make them (real vLLM generator, real megatron trainer):

- the demo with pass@k (``eval.samples=4``) and every tracker (``logger=[tensorboard,wandb,mlflow]``):
  W&B's offline run file and MLflow's file store hold every step's reward; pass@k and greedy
  accuracy equal a count made here from the per-prompt answers (completion ids decoded and scored by
  the task, not by the orchestrator); `tokenflow compare` and TensorBoard show them;
- verl's GSM8K Parquet layout, a `datasets` directory and JSONL, each with nothing but ``task.path``
  (the tiny model's defaults; it answers badly, the point is that the data trains and is evaluated
  by held-out set and data source).

Cost on 2 cores (module fixture): the four runs at once, one OpenMP thread per process, 80-86 s
under `heavy-all` (load 4-17), the whole module with tests/tasks/test_user_datasets.py 86-93 s;
before, the demo and then the three formats, two torch threads each: 100-128 s, the two files
109-138 s (bench/results/2026-12-06-startup.md; the demo's warm-start cached).
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


def start_train(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """`tokenflow train` of a short run in ``run_dir`` (its output in ``run_dir``.out). One OpenMP
    thread per process: the runs share the cores unpinned, and a two-thread torch pool whose other
    thread waits for a core spins (the four runs at once: 206 -> 173 CPU s, 108 -> 92 s)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pipeline.cli", "train", f"run.name={run_dir.name}", f"hydra.run.dir={run_dir}",
           *COMMON, *overrides]
    with open(run_dir.with_suffix(".out"), "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def finish_train(run_dir: Path, proc: subprocess.Popen) -> None:
    try:
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, f"train {run_dir.name} failed:\n{run_dir.with_suffix('.out').read_text()[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Four `tokenflow train` runs started at once, placed by the OS (no core plan: with one, every
    run's generator would share core 0): the demo with pass@k and every tracker, and the same 200
    problems as verl's GSM8K Parquet, a `datasets` directory and JSONL, each trained (2 steps, no
    tracker) with nothing but ``task=dataset task.path=...`` (the tiny model's budgets, warm-start
    and engine are the defaults'; the held-out evaluation in the Parquet run only, by held-out set
    and data source). One run alone leaves a core idle while its processes wait for each other."""
    import datasets

    from test_user_datasets import gsm8k_rows, write_gsm8k_parquet

    root = tmp_path_factory.mktemp("users")
    parquet = write_gsm8k_parquet(root / "gsm8k.parquet")
    saved = root / "saved"
    datasets.Dataset.from_parquet(str(parquet)).save_to_disk(str(saved))
    jsonl = root / "flat.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": r["prompt"][0]["content"],
                                         "answer": r["reward_model"]["ground_truth"]}) + "\n" for r in gsm8k_rows(200)))
    overrides = {"demo": ["eval.samples=4", "eval.temperature=1.0", "logger=[tensorboard,wandb,mlflow]"]}
    for fmt, path in {"parquet": parquet, "saved": saved, "jsonl": jsonl}.items():
        overrides[fmt] = ["task=dataset", f"task.path={path}", "logger=[]",
                          *([] if fmt == "parquet" else ["run.eval_every=0"])]
    started, failed = {}, []
    try:
        for name, extra in overrides.items():
            started[name] = start_train(root / name, "cluster.cpu_plan=none", *extra)
    finally:
        for name, proc in started.items():  # every run waited for (or killed) before any failure is reported
            try:
                finish_train(root / name, proc)
            except (AssertionError, subprocess.TimeoutExpired) as e:
                failed.append(str(e))
    assert not failed, "\n".join(failed)
    return {name: root / name for name in overrides}


@pytest.fixture(scope="module")
def demo(runs) -> Path:
    return runs["demo"]


def test_pass_at_k_equals_a_count_of_the_recorded_answers(demo):
    from tokenizers import Tokenizer

    from pipeline.run_dir import model_dir
    from pipeline.tasks import TaskConfig, make_task

    tokenizer = Tokenizer.from_file(str(model_dir(demo) / "tokenizer.json"))  # the `tokenizers` library itself
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
            scores = [task.score(prompts[i], tokenizer.decode(list(ids), skip_special_tokens=True))
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


@pytest.mark.parametrize("fmt", ["parquet", "saved", "jsonl"])
def test_every_format_trains_with_nothing_but_its_path(runs, fmt):
    """The formats themselves are checked without engines in tests/tasks/test_user_datasets.py."""
    run = runs[fmt]
    steps = list(read_metrics(run, "train_step"))
    assert [s["step"] for s in steps] == [0, 1] and all(np.isfinite(s["reward_mean"]) for s in steps)
    assert all(s["samples"] == 8 for s in steps)  # 2 groups of 4
    (dataset,) = read_metrics(run, "dataset")
    assert (dataset["train_rows"], dataset["eval_prompts"], dataset["bad_rows"]) == (160, 40, 0)
    if fmt == "parquet":
        evals = list(read_metrics(run, "eval"))
        assert [e["n"] for e in evals] == [40, 40] and all(e["n/heldout"] == 40 for e in evals)
        assert all(e["n/source/openai/gsm8k"] == 40 for e in evals)
    if fmt != "jsonl":  # verl's data_source column came through: rewards by source
        by_source = [r["reward_mean/source/openai/gsm8k"] for r in read_metrics(run, "orchestrator")
                     if "reward_mean/source/openai/gsm8k" in r]
        assert by_source and all(0.0 <= r <= 1.0 for r in by_source)
