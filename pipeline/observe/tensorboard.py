"""Mirror the run's metrics stream into TensorBoard scalars (``RUN/tensorboard``).

Every numeric field of a ``train_step`` or ``eval`` record becomes a scalar ``<kind>/<field>`` at
its step; ``generator`` and ``orchestrator`` records go under their kind at the trainer's latest
step (`pipeline.observe.follow.record_scalars`, shared with the experiment trackers). The mirror follows the files, so it can run beside the training job or after it.

When the mirror closes (the run ended, failed or was interrupted) it writes the run's HParams
session given by its caller (`pipeline.apps.ops.summary.run_hparams`: the command-line overrides
with the values the run resolved, plus ``task.name`` and ``model.name``, as hparams; the run's
summary numbers as the metrics ``hparams/<name>``), so ``tensorboard --logdir runs/sw-sweep``
compares the points of a sweep in its HParams view.

Invariants: the event file is TensorBoard's own format written by its own writer
(``tensorboard.summary.writer.EventFileWriter``, the one ``torch.utils.tensorboard`` wraps): one
``Event`` per scalar (a ``Summary.Value`` with ``simple_value``, its step and the record's wall
time), and the HParams session as the plugin's three summaries (experiment, session start with
every hparam, session end with status success). Nothing here imports torch, which the launcher
would otherwise pay for on every run (~2.7 CPU s of a 2-core machine's start-up).
"""
from __future__ import annotations

import time
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from pipeline.observe.follow import MetricsFollower, record_scalars
from pipeline.run_files import TENSORBOARD_DIR

#: Summary numbers written as HParams metrics (``hparams/<name>``).
HPARAM_METRICS = ("final_accuracy", "best_accuracy", "reward_last", "steps_done", "tokens_per_s",
                  "trainer_idle_frac", "staleness_mean", "drops", "wall_s")


def hparams_summaries(params: dict, metric_tags: list[str]) -> list[Summary]:
    """The HParams plugin's experiment, session-start and session-end summaries for ``params``
    (numbers and strings; ``None`` values left out; anything else is refused by name)."""
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    start = plugin_data_pb2.SessionStartInfo()
    infos = []
    for name, value in params.items():
        if value is None:
            continue
        if isinstance(value, (int, float)):  # a bool as 0 or 1, as torch's writer did
            start.hparams[name].number_value, kind = value, "DATA_TYPE_FLOAT64"
        elif isinstance(value, str):
            start.hparams[name].string_value, kind = value, "DATA_TYPE_STRING"
        else:
            raise ValueError(f"hparam {name!r}: {type(value).__name__} is not a number, string or bool")
        infos.append(api_pb2.HParamInfo(name=name, type=api_pb2.DataType.Value(kind)))
    experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=[
        api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag)) for tag in metric_tags])
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value("STATUS_SUCCESS"))
    out = []
    for tag, data in ((metadata.EXPERIMENT_TAG, {"experiment": experiment}),
                      (metadata.SESSION_START_INFO_TAG, {"session_start_info": start}),
                      (metadata.SESSION_END_INFO_TAG, {"session_end_info": end})):
        content = plugin_data_pb2.HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **data)
        plugin = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME, content=content.SerializeToString())
        out.append(Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))]))
    return out


class TensorBoardMirror:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.follow = MetricsFollower(run_dir)
        self.writer = EventFileWriter(str(self.run_dir / TENSORBOARD_DIR))
        self.step = 0

    def add_scalar(self, tag: str, value: float, step: int, walltime: float | None = None) -> None:
        self.add_summary(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))]), step, walltime)

    def add_summary(self, summary: Summary, step: int, walltime: float | None = None) -> None:
        self.writer.add_event(Event(summary=summary, step=int(step),
                                    wall_time=time.time() if walltime is None else float(walltime)))

    def update(self) -> int:
        n = 0
        for rec in self.follow.poll():
            self.step, at, scalars = record_scalars(rec, self.step)
            for tag, value in scalars.items():
                self.add_scalar(tag, value, at, walltime=rec.get("t"))
                n += 1
        self.writer.flush()
        return n

    def write_hparams(self, params: dict, summary: dict) -> dict[str, float]:
        """Write the run's HParams session (see the module doc); returns the metrics written."""
        metrics = {f"hparams/{k}": float(summary[k]) for k in HPARAM_METRICS if summary.get(k) is not None}
        for proto in hparams_summaries(params, list(metrics)):  # experiment, session start, session end
            self.add_summary(proto, 0)
        for tag, value in metrics.items():
            self.add_scalar(tag, value, self.step)
        return metrics

    def close(self, hparams: tuple[dict, dict] | None = None) -> None:
        """Flush the last records; ``hparams`` = (params, summary numbers) of the run's HParams session."""
        self.update()
        if hparams is not None:
            self.write_hparams(*hparams)
        self.writer.close()
