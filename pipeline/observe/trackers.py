"""Experiment trackers: the run's metrics stream mirrored into Weights & Biases and MLflow.

``logger=[tensorboard,wandb,mlflow]`` (any subset) picks the mirrors `tokenflow train` runs while it
follows a run; this module is the W&B and MLflow ones (TensorBoard: pipeline.observe.tensorboard).

Invariants:
- The same scalars as TensorBoard, at the same steps (`pipeline.observe.follow.record_scalars`):
  every numeric field of every metrics record (``RUN/metrics/``), ``<kind>/<field>``. W&B gets the step as
  the metric ``trainer_step`` (every other metric's x-axis), not as its own ``step``, which must
  only grow: an evaluation of step 3 often arrives after the training record of step 4.
- Parameters: the run's resolved ``config.yaml``, flattened to dotted keys; nothing named like a
  secret (the run secret is a file and never in the config; a key containing ``secret`` or
  ``password`` is left out all the same).
- W&B runs offline unless ``tracking.wandb_mode=online``: its files go to ``RUN/trackers/wandb``
  (``wandb sync RUN/trackers/wandb/offline-run-*`` uploads them later, from a node with internet).
  MLflow writes to ``tracking.mlflow_tracking_uri``, by default a file store in
  ``RUN/trackers/mlflow`` (MLflow 3 keeps its file store in maintenance: ``MLFLOW_ALLOW_FILE_STORE``
  is set for it).
- A sweep's points (run directories ``runs/<name>-sweep/<point>``) are grouped: the W&B group and the
  MLflow experiment are the sweep directory's name; a run resumed in the same directory continues
  the same W&B run id and the same MLflow run (tag ``tokenflow.run_dir``).
- A tracker's failure never stops the run or the other mirrors: each failure is counted and written
  to the run's metrics as a ``tracker`` record (tracker, failures, error), which ``tokenflow status``
  shows; a tracker that failed to start is not retried. The libraries are imported only when chosen.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.metrics import MetricsWriter
from pipeline.observe.follow import MetricsFollower, record_scalars
from pipeline.run_files import CONFIG_FILE, TRACKERS_DIR

log = logging.getLogger(__name__)

#: What `logger` may name.
LOGGERS = ("tensorboard", "wandb", "mlflow")
#: Config keys never passed as parameters.
SECRET_WORDS = ("secret", "password")


@dataclass
class TrackingConfig:
    """Settings of the experiment trackers chosen with ``logger`` (pipeline.observe.trackers)."""

    wandb_project: str = "tokenflow"
    """W&B project of the run."""
    wandb_entity: str | None = None
    """W&B entity (team or user); None: the account's default."""
    wandb_mode: str = "offline"
    """"offline" (files in RUN/trackers/wandb, `wandb sync` later) or "online"."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; None: a file store in RUN/trackers/mlflow."""
    mlflow_experiment: str = "tokenflow"
    """MLflow experiment of a run outside a sweep (a sweep's points: the sweep's name)."""


def check_loggers(names: list[str], settings: TrackingConfig) -> None:
    """ValueError naming `logger` or the `tracking` field that is wrong."""
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"logger: unknown {unknown} (any of {list(LOGGERS)})")
    if settings.wandb_mode not in ("offline", "online"):
        raise ValueError(f"tracking.wandb_mode must be offline or online, got {settings.wandb_mode!r}")


def sweep_name(run_dir: Path) -> str | None:
    """The sweep a run directory is a point of (``<name>-sweep/<point>``), else None."""
    parent = Path(run_dir).resolve().parent.name
    return parent if parent.endswith("-sweep") else None


def run_params(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config, flattened to dotted keys, without secret-like keys."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():
        return {}
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node

    walk(OmegaConf.to_container(OmegaConf.load(path), resolve=False), "")
    return {k: v for k, v in flat.items() if not any(w in k.lower() for w in SECRET_WORDS)}


#: W&B's x-axis metric: the trainer step of a record.
STEP_METRIC = "trainer_step"


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, settings: TrackingConfig, params: dict[str, Any]):
        import wandb

        directory = Path(run_dir) / TRACKERS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        run_id = hashlib.blake2b(str(Path(run_dir).resolve()).encode(), digest_size=8).hexdigest()
        self.run = wandb.init(project=settings.wandb_project, entity=settings.wandb_entity, dir=str(directory),
                              mode=settings.wandb_mode, name=Path(run_dir).name if sweep_name(run_dir) else
                              params.get("run.name") or Path(run_dir).name, group=sweep_name(run_dir),
                              id=run_id, resume="allow", config=params, reinit="create_new",
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({STEP_METRIC: step, **scalars})

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # ends wandb's service process (wandb-core), which flushes the run file


class MlflowTracker:
    name = "mlflow"

    def __init__(self, run_dir: Path, settings: TrackingConfig, params: dict[str, Any]):
        uri = settings.mlflow_tracking_uri
        if uri is None:
            store = (Path(run_dir) / TRACKERS_DIR / "mlflow").resolve()
            store.mkdir(parents=True, exist_ok=True)
            uri = store.as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment = sweep_name(run_dir) or settings.mlflow_experiment
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        where = str(Path(run_dir).resolve())
        runs = self.client.search_runs([experiment_id], filter_string=f"tags.`tokenflow.run_dir` = '{where}'")
        if runs:
            self.run_id = runs[0].info.run_id
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=Path(run_dir).name,
                                                 tags={"tokenflow.run_dir": where}).info.run_id
            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(re.sub(r"[^\w\-. :/]", "_", k), float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


class TrackerMirror:
    """Follows the run's metrics stream into the chosen trackers (see the module invariants)."""

    def __init__(self, run_dir: Path, names: list[str], settings: TrackingConfig):
        self.run_dir = Path(run_dir)
        self.follow = MetricsFollower(run_dir)
        self.writer: MetricsWriter | None = None  # the failure records, opened at the first failure
        self.failures: Counter[str] = Counter()
        self.step = 0
        self.trackers: list[Any] = []
        params = run_params(run_dir)
        for name in names:
            if name in TRACKERS:
                tracker = self._attempt(name, lambda: TRACKERS[name](self.run_dir, settings, params))
                if tracker is not None:
                    self.trackers.append(tracker)

    def _attempt(self, name: str, call):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
            self.failures[name] += 1
            log.warning("tracker %s failed: %r", name, exc)
            if self.writer is None:
                self.writer = MetricsWriter(self.run_dir, "trackers")
            self.writer.log("tracker", tracker=name, failures=self.failures[name], error=repr(exc)[:500])
            return None

    def update(self) -> None:
        for rec in self.follow.poll():
            if rec.get("kind") == "tracker":
                continue  # the mirror's own failure records
            self.step, at, scalars = record_scalars(rec, self.step)
            if scalars:
                for tracker in self.trackers:
                    self._attempt(tracker.name, lambda: tracker.log(at, scalars))

    def close(self) -> None:
        self.update()
        for tracker in self.trackers:
            self._attempt(tracker.name, tracker.close)
        if self.writer is not None:
            self.writer.close()
