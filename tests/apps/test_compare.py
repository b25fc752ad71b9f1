"""`tokenflow compare`, `tokenflow status SWEEP_DIR`, the end-of-sweep report and TensorBoard HParams.

The unit tests build run directories the way a run leaves them: the resolved config written by
`save_run_config`, Hydra's override record, the launch record and plan, task results, and a metrics
stream written by the real `MetricsWriter`; expected numbers are computed here from the values the
test wrote. The engine test runs a real two-point sweep and checks the printed table against each
point's metrics records (`read_metrics`).
"""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from pipeline.config import TokenflowConfig
from pipeline.metrics import MetricsWriter, read_metrics
from pipeline.apps.ops import status_main
from pipeline.apps.ops.compare import compare_runs, format_table, main as compare_main
from pipeline.apps.ops.summary import metric_summary, run_hparams, wall_seconds
from pipeline.apps.ops.sweep import find_runs
from pipeline.run_dir import save_run_config
from pipeline.apps.train import job_plan

ERROR = "RuntimeError: no batch for step 1 from the orchestrator within 300 s"


def make_run(run_dir: Path, lr: float, rewards: list[float], evals: list[tuple[int, float]], *, steps: int = 3,
             outcome: str = "finished", task: str = "sort", pids: list[int] | None = None) -> Path:
    """A run directory as a local run leaves it after `rewards` steps; outcome "finished", "failed" or "running"."""
    cfg = TokenflowConfig()
    cfg.run.name, cfg.run.dir, cfg.run.steps, cfg.trainer.lr, cfg.task.name = "sw", str(run_dir), steps, lr, task
    run_dir.mkdir(parents=True)
    save_run_config(run_dir, cfg)
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text(
        f"- run.name=sw\n- run.steps={steps}\n- trainer.lr={lr}\n- hydra.verbose=false\n")
    (run_dir / "launch").mkdir()
    (run_dir / "launch" / "plan.json").write_text(job_plan(cfg, run_dir).to_json())
    (run_dir / "launch" / "launches.jsonl").write_text(json.dumps(
        {"launcher": "local", "time": time.time() - 1, "launch_index": 0, "job_id": None, "pids": pids or []}) + "\n")
    trainer, orchestrator = MetricsWriter(run_dir, "trainer"), MetricsWriter(run_dir, "orchestrator")
    generator = MetricsWriter(run_dir, "generator.0")
    for step, reward in enumerate(rewards):
        trainer.log("train_step", step=step, version=step + 1, reward_mean=reward, samples=32,
                    staleness_mean=step % 2, staleness_max=1, tokens=250 + 10 * step, wait_s=90.0 if step == 0 else 1.0,
                    step_s=2.5, sync_s=0.5, trainer_idle_frac=0.9)
        generator.log("generator", generator_id=0, version=step, tokens_per_s=150.0)
        orchestrator.log("orchestrator", buffer_groups=2, in_flight=1, count_dropped_stale=step)
    for step, accuracy in evals:
        orchestrator.log("eval", step=step, version=step, accuracy=accuracy, n=200)
    for w in (trainer, orchestrator, generator):
        w.close()
    (run_dir / "results").mkdir()
    for role in ("trainer", "generator"):
        if outcome == "failed" and role == "trainer":
            try:
                raise RuntimeError(ERROR.split(": ", 1)[1])
            except RuntimeError:
                record = {"ok": False, "attempt": 0, "node": "localhost", "error": traceback.format_exc()}
        else:
            record = {"ok": True, "attempt": 0, "node": "localhost", "result": {"steps": len(rewards)}, "stopped": False}
        if outcome != "running":
            (run_dir / "results" / f"{role}.0.json").write_text(json.dumps(record))
    return run_dir


@pytest.fixture
def sweep(tmp_path) -> Path:
    """Point 0 finished 3 steps; point 1 failed after 1 step."""
    root = tmp_path / "sw-sweep"
    make_run(root / "0", 1e-4, [0.2, 0.4, 0.6], [(0, 0.30), (2, 0.55), (3, 0.50)])
    make_run(root / "1", 3e-4, [0.1], [(0, 0.30)], outcome="failed")
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def test_compare_json_shows_the_failed_point_with_its_error(sweep, capsys):
    assert compare_main([str(sweep), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["columns"] == ["trainer.lr"] and result["incomparable"] == []
    done, failed = result["runs"]
    assert (done["run"], done["overrides"], done["state"], done["error"]) == ("0", {"trainer.lr": 1e-4}, "finished", None)
    assert (failed["run"], failed["overrides"], failed["state"]) == ("1", {"trainer.lr": 3e-4}, "failed")
    assert failed["error"] == f"trainer.0: {ERROR}"
    assert (done["final_accuracy"], done["final_accuracy_step"]) == (0.50, 3)
    assert (done["best_accuracy"], done["best_accuracy_step"]) == (0.55, 2)
    assert done["reward_last"] == pytest.approx((0.2 + 0.4 + 0.6) / 3)
    assert (done["steps_done"], done["steps"], failed["steps_done"]) == (3, 3, 1)
    assert done["staleness_mean"] == pytest.approx(1 / 3)
    # The loop of steps 1 and 2 (step 0's wait holds the start-up): 4 s each, 1 s of it waiting.
    assert done["tokens_per_s"] == pytest.approx((260 + 270) / 8) and done["trainer_idle_frac"] == pytest.approx(0.25)
    assert failed["tokens_per_s"] == pytest.approx(250 / 93) and done["drops"] == 2
    assert result["best"] == "0"


def test_table_csv_and_the_last_steps_window(sweep, capsys):
    assert compare_main([str(sweep), "--last", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["run", "trainer.lr", "final", "acc"]
    assert lines[1].split()[:5] == ["0", "0.0001", "0.500", "0.550@2", "0.50"]  # reward of the last 2 steps
    assert lines[2].split()[:3] == ["1", "0.0003", "0.300"] and lines[2].endswith(f"failed: trainer.0: {ERROR}")
    assert lines[3] == "best final held-out accuracy: run 0: trainer.lr=0.0001: 0.500 at step 3"
    assert compare_main([str(sweep / "1"), str(sweep / "0"), "--csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["run"], r["trainer.lr"], r["state"]) for r in rows] == [("1", "0.0003", "failed"), ("0", "0.0001", "finished")]
    assert float(rows[1]["final_accuracy"]) == 0.5 and rows[0]["error"] == f"trainer.0: {ERROR}"


def test_runs_of_another_task_are_listed_with_that_difference_first(tmp_path):
    a = make_run(tmp_path / "a", 1e-4, [0.5], [(1, 0.4)])
    b = make_run(tmp_path / "b", 3e-4, [0.5], [(1, 0.6)], task="addition")
    result = compare_runs(find_runs([str(tmp_path / "*")]))
    assert [r["run_dir"] for r in result["runs"]] == [str(a), str(b)]
    assert result["columns"] == ["task.name", "trainer.lr"] and result["incomparable"] == ["task.name"]
    table = format_table(result).splitlines()
    assert table[0].split()[:3] == ["run", "task.name!", "trainer.lr"]
    assert table[-1].startswith("note: the runs differ in task.name (marked !)")


def test_a_run_still_going_is_shown_as_it_stands(tmp_path, capsys):
    run_dir = tmp_path / "live"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(run_dir)])
    try:
        make_run(run_dir, 1e-4, [0.3, 0.5], [(0, 0.2)], steps=10, outcome="running", pids=[sleeper.pid, sleeper.pid])
        assert compare_main([str(run_dir), "--json"]) == 0
        (run,) = json.loads(capsys.readouterr().out)["runs"]
        assert (run["state"], run["steps_done"], run["steps"], run["final_accuracy"]) == ("running", 2, 10, 0.2)
    finally:
        sleeper.kill()
        sleeper.wait()
    (run,) = compare_runs([run_dir])["runs"]
    assert run["state"] == "failed" and run["error"] == "stopped at step 2/10"


def test_status_of_a_sweep_lists_every_point(sweep, capsys):
    assert status_main([str(sweep)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[2:] == ["2", "point(s)"]
    assert lines[1].split()[:3] == ["point", "trainer.lr", "job"]
    assert lines[2].split()[:6] == ["0", "0.0001", "local", "trainer", "EXITED,", "generator"]
    assert lines[3].endswith(f"trainer.0: {ERROR}") and "1/3" in lines[3].split()
    assert status_main([str(sweep), "--json"]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [p["status"]["steps_done"] for p in points] == [3, 1]


def test_the_overlay_plot_is_written(sweep, tmp_path, capsys):
    out = tmp_path / "compare.png"
    assert compare_main([str(sweep), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert capsys.readouterr().out.splitlines()[-1] == f"curves in {out}"


def test_bad_paths_are_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert compare_main([str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such directory" in capsys.readouterr().err
    assert compare_main([str(tmp_path / "empty")]) == 2
    assert "neither a run directory" in capsys.readouterr().err


def test_a_resumed_run_counts_redone_steps_once_and_drops_over_restarts(tmp_path):
    """Steps 0-2, then a resume from the checkpoint at 2 redoes step 2; the orchestrator counted
    dropped_stale 2, 5, then (restarted) 1, 3 -> 8 (the summary module's worked example)."""
    trainer, orchestrator = MetricsWriter(tmp_path, "trainer"), MetricsWriter(tmp_path, "orchestrator")
    for step, reward in ((0, 0.1), (1, 0.2), (2, 0.9), (2, 0.3)):
        trainer.log("train_step", step=step, reward_mean=reward)
    for stale, future in ((2, 0), (5, 1), (1, 0), (3, 0)):
        orchestrator.log("orchestrator", count_dropped_stale=stale, count_dropped_future_version=future, count_stored=9)
    trainer.close()
    orchestrator.close()
    summary = metric_summary(tmp_path)
    assert summary["steps_done"] == 3 and summary["reward_last"] == pytest.approx((0.1 + 0.2 + 0.3) / 3)
    assert summary["drops_by_reason"] == {"stale": 8, "future_version": 1} and summary["drops"] == 9


def test_wall_time_counts_each_launch_to_its_last_record():
    # The module's worked example: records 100..160 after the launch at 100, 1000..1030 after the resume.
    assert wall_seconds([100.0, 1000.0], [100.0, 130.0, 160.0, 1000.0, 1030.0], running=False) == 90.0
    assert wall_seconds([], [5.0, 12.5], running=False) == 7.5


def read_hparams(tb_dir: Path) -> tuple[dict, dict]:
    """(hparams, metrics) of a run's TensorBoard directory, read by TensorBoard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    params = {k: v.number_value if v.HasField("number_value") else v.string_value for k, v in start.hparams.items()}
    metrics = {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"] if tag.startswith("hparams/")}
    return params, metrics


def test_the_hparams_session_is_readable_by_tensorboard(sweep):
    from pipeline.observe.tensorboard import TensorBoardMirror

    TensorBoardMirror(sweep / "0").close(hparams=run_hparams(sweep / "0"))
    params, metrics = read_hparams(sweep / "0" / "tensorboard")
    assert params == {"trainer.lr": pytest.approx(1e-4), "run.steps": 3.0, "task.name": "sort", "model.name": "tiny-moe"}
    assert metrics["hparams/final_accuracy"] == pytest.approx(0.50)
    assert metrics["hparams/best_accuracy"] == pytest.approx(0.55)
    assert metrics["hparams/steps_done"] == 3.0 and metrics["hparams/drops"] == 2.0


@pytest.mark.engine
@pytest.mark.slow  # about 2.5 min on 2 cores (140 s measured): two points, each starts its engine
def test_a_local_sweep_ends_with_its_points_compared(tmp_path):
    sweep = tmp_path / "sw-sweep"
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "-m", "run.name=sw", "run.steps=2", "trainer.lr=1e-4,3e-4",
           f"hydra.sweep.dir={sweep}", "run.eval_every=2", "run.checkpoint_every=2", "run.mismatch_every=0",
           "run.timeout_s=300", "run.progress=false", "orchestrator.groups_per_step=4", "orchestrator.group_size=8"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=900)
    assert out.returncode == 0, f"sweep failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run ") and "trainer.lr" in line)
    rows = [line.split() for line in lines[header + 1:header + 3]]
    for point, lr, row in (("0", "0.0001", rows[0]), ("1", "0.0003", rows[1])):
        final = list(read_metrics(sweep / point, "eval"))[-1]
        assert final["step"] == 2
        assert row[:3] == [point, lr, f"{final['accuracy']:.3f}"], lines[header:header + 3]
        assert row[-1] == "finished" and row[-7] == "2/2"  # steps, then tok/s idle stale drops wall state
        params, metrics = read_hparams(sweep / point / "tensorboard")
        assert params["trainer.lr"] == pytest.approx(float(lr))
        assert metrics["hparams/final_accuracy"] == pytest.approx(final["accuracy"])
    png = sweep / "compare.png"
    assert lines[-1] == f"tokenflow: sweep done; curves of all points in {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


SLURM_TINY = ["cluster=slurm", "run.timeout_s=300", "run.progress=false", "logger=[]",
              "orchestrator.groups_per_step=4", "orchestrator.group_size=8", "cluster.generators=1",
              "cluster.generator.nodes=1", "cluster.trainer.mem_gb=3", "cluster.generator.mem_gb=3.5",
              "cluster.trainer.cpus_per_task=2", "cluster.generator.cpus_per_task=2", "cluster.trainer.time_min=30",
              "cluster.generator.time_min=30"]


@pytest.mark.slurm
@pytest.mark.engine
def test_a_detached_slurm_sweep_is_followed_from_its_directory(tmp_path):
    """Every point's job and state from `tokenflow status SWEEP_DIR`, while it waits or runs and after
    `tokenflow cancel` of each point (then `compare` shows the points failed, cancelled)."""
    def tokenflow(*args: str) -> subprocess.CompletedProcess:
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                             timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        return out

    sweep = tmp_path / "ssw-sweep"
    out = tokenflow("train", "-m", "trainer.lr=1e-4,2e-4", "run.name=ssw", f"hydra.sweep.dir={sweep}", "run.detach=true",
                    "run.steps=2", *SLURM_TINY)
    jobs = [str(json.loads((sweep / p / "launch" / "launches.jsonl").read_text())["job_id"]) for p in ("0", "1")]
    try:
        listing = out.stdout.splitlines()
        header = listing.index(next(line for line in listing if line.startswith("point ")))
        assert [line.split()[:3] for line in listing[header + 1:header + 3]] == \
            [["0", "0.0001", jobs[0]], ["1", "0.0002", jobs[1]]]
        status = json.loads(tokenflow("status", str(sweep), "--json").stdout)
        assert [str(p["status"]["job_id"]) for p in status["points"]] == jobs
        for point in status["points"]:
            assert [c["state"] for c in point["status"]["components"]] != [] and all(
                c["state"] in ("PENDING", "CONFIGURING", "RUNNING") for c in point["status"]["components"]), status
        runs = json.loads(tokenflow("compare", str(sweep), "--json").stdout)["runs"]
        assert all(r["state"] in ("pending", "running") for r in runs), runs
    finally:
        for point in ("0", "1"):
            tokenflow("cancel", str(sweep / point))
    deadline = time.monotonic() + 90
    while True:
        runs = json.loads(tokenflow("compare", str(sweep), "--json").stdout)["runs"]
        if all(r["state"] == "failed" for r in runs) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert [r["state"] for r in runs] == ["failed", "failed"], runs
    assert all("CANCELLED" in r["error"] for r in runs), runs
    assert f"{jobs[1]}" in tokenflow("status", str(sweep)).stdout
