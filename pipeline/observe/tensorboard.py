"""Mirror the run's metrics stream into TensorBoard scalars (``RUN/tensorboard``).

Every numeric field of a ``train_step`` or ``eval`` record becomes a scalar ``<kind>/<field>`` at
its step; ``generator`` and ``orchestrator`` records go under their kind at the trainer's latest
step. The mirror follows the file, so it can run beside the training job or after it.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.observe.follow import MetricsFollower
from pipeline.run_files import TENSORBOARD_DIR

SKIP = {"t", "role", "kind", "step"}


class TensorBoardMirror:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter
        self.follow = MetricsFollower(run_dir)
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))
        self.step = 0

    def update(self) -> int:
        n = 0
        for rec in self.follow.poll():
            kind = rec.get("kind")
            step = rec.get("step")
            if kind in ("train_step", "eval") and isinstance(step, int):
                self.step = max(self.step, step)
            at = step if isinstance(step, int) else self.step
            prefix = kind if kind != "generator" else f"generator{rec.get('generator_id', '')}"
            for key, value in rec.items():
                if key not in SKIP and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(f"{prefix}/{key}", value, at, walltime=rec.get("t"))
                    n += 1
        self.writer.flush()
        return n

    def close(self) -> None:
        self.update()
        self.writer.close()
