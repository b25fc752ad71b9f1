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
from typing import Any, Iterator

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
