"""Experiment trackers (pipeline.observe.trackers) fed by a metrics stream, read back with each
tracker's own API: MLflow's client, and W&B's own record type (`wandb_internal_pb2.Record`) from the
offline run file. wandb 0.31 ships no Python reader of its ``.wandb`` files (its scanner is in the Go
`wandb-core`), so `wandb_records` walks the file's documented framing (LevelDB's log format: 32 KiB
blocks of records with a 7-byte header) and leaves the decoding to wandb's protobuf."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from pipeline.apps.ops import format_status, run_status
from pipeline.metrics import MetricsWriter, read_metrics
from pipeline.observe.trackers import TrackerMirror, TrackingConfig, run_params

BLOCK = 32 * 1024


def wandb_records(path: Path):
    """wandb's Record messages of an offline run file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(run_root: Path) -> list[dict]:
    (run_file,) = (run_root / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def _fake_run(run_dir: Path, steps: int) -> dict[int, float]:
    """A run directory as a run leaves it: config.yaml and a metrics stream (evals arrive late)."""
    from omegaconf import OmegaConf

    from pipeline.config import TokenflowConfig

    run_dir.mkdir(parents=True)
    cfg = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(TokenflowConfig)))
    cfg.run.dir, cfg.run.steps, cfg.trainer.lr = str(run_dir), 5, 0.0002
    cfg.orchestrator.transport.secret_file = "/should/not/appear"
    OmegaConf.save(cfg, run_dir / "config.yaml")
    rewards = {s: round(0.1 * s + 0.05, 3) for s in range(steps)}
    m = MetricsWriter(run_dir, "trainer")
    for s in range(steps):
        m.log("train_step", step=s, version=s, reward_mean=rewards[s])
        if s % 2 == 1:
            m.log("eval", step=s - 1, version=s - 1, accuracy=0.5, n=200, pass_at_k=0.75, k=4)
        m.log("orchestrator", buffer_groups=s)
    m.close()
    return rewards


def test_wandb_offline_and_mlflow_file_store_get_every_step(tmp_path):
    run = tmp_path / "sw-sweep" / "0"
    rewards = _fake_run(run, 5)
    mirror = TrackerMirror(run, ["tensorboard", "wandb", "mlflow"], TrackingConfig())
    mirror.update()
    mirror.close()
    assert not mirror.failures and not list(read_metrics(run, "tracker"))

    history = wandb_history(run)
    got = {r["trainer_step"]: r["train_step/reward_mean"] for r in history if "train_step/reward_mean" in r}
    assert got == rewards
    evals = {r["trainer_step"]: r["eval/pass_at_k"] for r in history if "eval/pass_at_k" in r}
    assert evals == {0: 0.75, 2: 0.75}  # logged after later training steps, kept at their own step
    (run_file,) = (run / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")
    (header,) = [r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in header.config.update}
    assert config["trainer.lr"] == 0.0002 and config["run.steps"] == 5
    assert header.run_group == "sw-sweep" and not any("secret" in k for k in config)

    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=(run / "trackers" / "mlflow").resolve().as_uri())
    experiment = client.get_experiment_by_name("sw-sweep")  # a sweep's points share one experiment
    (found,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(found.info.run_id, "train_step/reward_mean")
    assert {m.step: round(m.value, 3) for m in history} == rewards
    assert found.data.params["trainer.lr"] == "0.0002" and "run.name" in found.data.params
    assert not any("secret" in k for k in found.data.params)


def test_a_failing_tracker_is_counted_and_shown_and_the_others_go_on(tmp_path):
    run = tmp_path / "demo"
    rewards = _fake_run(run, 3)
    assert "orchestrator.transport.secret_file" not in run_params(run) and run_params(run)["run.steps"] == 5
    mirror = TrackerMirror(run, ["wandb", "mlflow"], TrackingConfig(mlflow_tracking_uri="nosuchscheme://x"))
    mirror.update()
    mirror.close()
    (failure,) = read_metrics(run, "tracker")
    assert failure["tracker"] == "mlflow" and failure["failures"] == 1 and "nosuchscheme" in failure["error"]
    got = {r["trainer_step"]: r["train_step/reward_mean"] for r in wandb_history(run)
           if "train_step/reward_mean" in r}
    assert got == rewards
    (run / "launch").mkdir()
    (run / "launch" / "plan.json").write_text(json.dumps({"components": {"trainer": {"nodes": 1, "tasks_per_node": 1}}}))
    (run / "launch" / "launches.jsonl").write_text(json.dumps({"launcher": "local", "time": 0, "pids": []}) + "\n")
    status = run_status(run)
    assert status["tracker_failures"]["mlflow"]["failures"] == 1
    assert "tracker    mlflow: 1 failure(s)" in format_status(status)
