"""Mirror the run's metrics stream into TensorBoard scalars (``RUN/tensorboard``).

Every numeric field of a ``train_step`` or ``eval`` record becomes a scalar ``<kind>/<field>`` at
its step; ``generator`` and ``orchestrator`` records go under their kind at the trainer's latest
step (`pipeline.observe.follow.record_scalars`, shared with the experiment trackers). The mirror follows the file, so it can run beside the training job or after it.

When the mirror closes (the run ended, failed or was interrupted) it writes the run's HParams
session given by its caller (`pipeline.apps.ops.summary.run_hparams`: the command-line overrides
with the values the run resolved, plus ``task.name`` and ``model.name``, as hparams; the run's
summary numbers as the metrics ``hparams/<name>``), so ``tensorboard --logdir runs/sw-sweep``
compares the points of a sweep in its HParams view.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.observe.follow import MetricsFollower, record_scalars
from pipeline.run_files import TENSORBOARD_DIR

#: Summary numbers written as HParams metrics (``hparams/<name>``).
HPARAM_METRICS = ("final_accuracy", "best_accuracy", "reward_last", "steps_done", "tokens_per_s",
                  "trainer_idle_frac", "staleness_mean", "drops", "wall_s")


class TensorBoardMirror:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter
        self.run_dir = Path(run_dir)
        self.follow = MetricsFollower(run_dir)
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))
        self.step = 0

    def update(self) -> int:
        n = 0
        for rec in self.follow.poll():
            self.step, at, scalars = record_scalars(rec, self.step)
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, at, walltime=rec.get("t"))
                n += 1
        self.writer.flush()
        return n

    def write_hparams(self, params: dict, summary: dict) -> dict[str, float]:
        """Write the run's HParams session (see the module doc); returns the metrics written."""
        from torch.utils.tensorboard.summary import hparams

        metrics = {f"hparams/{k}": float(summary[k]) for k in HPARAM_METRICS if summary.get(k) is not None}
        for proto in hparams(params, metrics):  # experiment, session start, session end
            self.writer.file_writer.add_summary(proto)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, self.step)
        return metrics

    def close(self, hparams: tuple[dict, dict] | None = None) -> None:
        """Flush the last records; ``hparams`` = (params, summary numbers) of the run's HParams session."""
        self.update()
        if hparams is not None:
            self.write_hparams(*hparams)
        self.writer.close()
