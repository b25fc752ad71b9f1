"""One JSONL metrics stream per run (`docs/architecture.md`, "Contracts"): ``RUN/metrics.jsonl``.

Each line is one JSON object ``{"t": unix_time, "role": ..., "kind": ..., <scalars>}``. The stream
is append-only and line-buffered, so the progress display, TensorBoard export, plots and
``tokenflow status`` can read it while the run writes it; a torn last line (a killed writer) is
skipped by `read_metrics`.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

from pipeline.run_files import METRICS_FILE


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):  # numpy scalars
        return _clean(v.item())
    return v


class MetricsWriter:
    def __init__(self, run_dir: Path, role: str):
        self.path = Path(run_dir) / METRICS_FILE
        self.role = role
        self._f = open(self.path, "a", buffering=1, encoding="utf-8")

    def log(self, kind: str, **values: Any) -> None:
        rec = {"t": round(time.time(), 3), "role": self.role, "kind": kind}
        rec.update({k: _clean(v) for k, v in values.items()})
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._f.close()


def read_metrics(run_dir: Path, kind: str | None = None) -> Iterator[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if kind is None or rec.get("kind") == kind:
                yield rec


def latest_by_step(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One record per step (the last written for it: a step repeated after a restart), in step order."""
    by_step: Dict[int, Dict[str, Any]] = {}
    for rec in records:
        if isinstance(rec.get("step"), int):
            by_step[rec["step"]] = rec
    return [by_step[k] for k in sorted(by_step)]


def mismatch_points(steps: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The first and last measured train-inference mismatch of `steps` (train_step records, one per
    step, in step order) with their steps; None where none was measured."""
    measured = [s for s in steps if isinstance(s.get("mismatch"), (int, float))]
    first, last = (measured[0], measured[-1]) if measured else (None, None)
    return {"mismatch_first": first["mismatch"] if first else None, "mismatch_first_step": first["step"] if first else None,
            "mismatch_last": last["mismatch"] if last else None, "mismatch_last_step": last["step"] if last else None}
