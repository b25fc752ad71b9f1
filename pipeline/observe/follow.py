"""Incremental reading of a run's metrics files (they grow, and new ones appear, while the run
writes them: pipeline.metrics), and the scalars every mirror (TensorBoard, experiment trackers)
takes from one record (`record_scalars`).

Invariant: `MetricsFollower.poll` returns each complete line of every file once, in the order
`pipeline.metrics.read_metrics` would (each poll's new records merged by time); a file that appears
later (a restarted role's new life) is read from its start.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.metrics import merge_by_time, metrics_files, parse_record


#: Fields of a metrics record that are not scalars of it.
NOT_SCALARS = {"t", "role", "kind", "step"}


def record_scalars(rec: dict[str, Any], latest_step: int) -> tuple[int, int, dict[str, float]]:
    """(latest step, step, {"<kind>/<field>": value}) of one record: every numeric field; a
    ``train_step`` or ``eval`` record at its own step (the new latest step when later), any other at
    `latest_step` (``generator`` records under ``generator<id>``)."""
    kind, step = rec.get("kind"), rec.get("step")
    if kind in ("train_step", "eval") and isinstance(step, int):
        latest_step = max(latest_step, step)
    at = step if isinstance(step, int) else latest_step
    prefix = kind if kind != "generator" else f"generator{rec.get('generator_id', '')}"
    return latest_step, at, {f"{prefix}/{key}": value for key, value in rec.items() if key not in NOT_SCALARS
                             and isinstance(value, (int, float)) and not isinstance(value, bool)}


class MetricsFollower:
    """Returns the records appended since the last call; a partial last line waits for its end."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.offsets: dict[Path, int] = {}  # bytes of each file read so far
        self.latest: dict[tuple[str, Any], dict[str, Any]] = {}

    def poll(self) -> list[dict[str, Any]]:
        batches = []
        for path in metrics_files(self.run_dir):
            offset = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1
            self.offsets[path] = offset + end
            batches.append([rec for line in data[:end].splitlines() if (rec := parse_record(line)) is not None])
        out = list(merge_by_time(batches))
        for rec in out:
            self.latest[(rec.get("kind"), rec.get("generator_id"))] = rec
        return out

    def last(self, kind: str) -> dict[str, Any] | None:
        """The newest record of a kind (for generators: the newest of any generator)."""
        recs = [r for (k, _), r in self.latest.items() if k == kind]
        return max(recs, key=lambda r: r.get("t", 0)) if recs else None

    def all_last(self, kind: str) -> list[dict[str, Any]]:
        return [r for (k, _), r in self.latest.items() if k == kind]
