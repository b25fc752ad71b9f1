"""A run's metrics (`docs/architecture.md`, "Contracts"): one JSONL file per writer process in
``RUN/metrics/``, read back as one stream merged in time order.

Each line is one JSON object ``{"t": unix_time, "role": ..., "kind": ..., <scalars>}``.

Invariants:
- One writer per file: a `MetricsWriter` creates its file exclusively (``<role>-<host>-<pid>.jsonl``,
  ``-1``, ``-2``... appended when that name is taken), so a restarted role's new life writes a new
  file, and no two processes append to one file (appends from several clients of a network
  filesystem are not atomic: they lose or tear each other's lines). The directory is private (0700).
- Each file is append-only and line-buffered, so the progress display, TensorBoard export, plots and
  ``tokenflow status`` read it while the run writes it; a torn last line (a killed writer) is skipped.
- `read_metrics` merges the files by ``t``; each file's records keep their order (ties too). A run
  directory written before this layout has one ``RUN/metrics.jsonl`` (`LEGACY_METRICS_FILE`): it is
  read as one more file.

Worked example: trainer (t 10.0, 12.0) in ``metrics/trainer-node1-41.jsonl`` and orchestrator
(t 11.0, 12.0) in ``metrics/orchestrator-node2-7.jsonl`` read back as trainer 10.0, orchestrator
11.0, orchestrator 12.0, trainer 12.0 (a tie goes to the file listed first: the legacy file, then
the directory's files by name).
"""
from __future__ import annotations

import heapq
import json
import math
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List

from pipeline.run_files import LEGACY_METRICS_FILE, METRICS_DIR


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):  # numpy scalars
        return _clean(v.item())
    return v


def _name_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text) or "_"


class MetricsWriter:
    """This process's metrics file for `role` (see the module invariants)."""

    def __init__(self, run_dir: Path, role: str):
        self.role = role
        folder = Path(run_dir) / METRICS_DIR
        folder.mkdir(mode=0o700, exist_ok=True)
        stem = f"{_name_part(role)}-{_name_part(socket.gethostname())}-{os.getpid()}"
        for n in range(1000):
            self.path = folder / (f"{stem}.jsonl" if n == 0 else f"{stem}-{n}.jsonl")
            try:
                self._f = open(self.path, "x", buffering=1, encoding="utf-8")
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"{folder}: {stem}.jsonl and its 999 numbered successors all exist")

    def log(self, kind: str, **values: Any) -> None:
        rec = {"t": round(time.time(), 3), "role": self.role, "kind": kind}
        rec.update({k: _clean(v) for k, v in values.items()})
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._f.close()


def metrics_files(run_dir: Path) -> List[Path]:
    """The run's metrics files: the legacy single file (if any), then the directory's files by name."""
    run_dir = Path(run_dir)
    legacy = run_dir / LEGACY_METRICS_FILE
    folder = run_dir / METRICS_DIR
    files = sorted(p for p in folder.glob("*.jsonl")) if folder.is_dir() else []
    return ([legacy] if legacy.is_file() else []) + files


def parse_record(line: bytes | str) -> Dict[str, Any] | None:
    """One metrics line as a record; None for a torn or foreign line (no object with a numeric ``t``)."""
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("t"), (int, float)):
        return None
    return rec


def _file_records(path: Path, kind: str | None) -> Iterator[Dict[str, Any]]:
    try:
        f = open(path, "rb")
    except FileNotFoundError:  # removed since listed
        return
    with f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # a killed writer's torn last line, or one still being written
            rec = parse_record(line)
            if rec is not None and (kind is None or rec.get("kind") == kind):
                yield rec


def merge_by_time(streams: Iterable[Iterable[Dict[str, Any]]]) -> Iterator[Dict[str, Any]]:
    """Records of several time-ordered streams in ``t`` order; ties (and each stream's own order) kept."""
    return heapq.merge(*streams, key=lambda rec: rec["t"])


def read_metrics(run_dir: Path, kind: str | None = None) -> Iterator[Dict[str, Any]]:
    """Every record of the run (of `kind`, if given), every file merged in time order."""
    return merge_by_time(_file_records(path, kind) for path in metrics_files(run_dir))


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
