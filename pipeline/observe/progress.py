"""A live progress line for a running training job, rendered from its metrics stream.

On a terminal the line is redrawn in place (stderr); elsewhere (Slurm logs, CI) a full line is
printed at most every ``log_every_s`` seconds, so logs stay readable.

Example::

    step 12/40 [###-------] reward 0.41  eval 0.63@v10  tok/s 5.2k  stale 0.8/1  idle T 12% G 4%  03:21
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from pipeline.observe.follow import MetricsFollower


def _pct(x) -> str:
    return "  -" if x is None else f"{100 * x:3.0f}%"


def _num(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _rate(x) -> str:
    if x is None:
        return "-"
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


class ProgressDisplay:
    def __init__(self, run_dir: Path, total_steps: int, stream: TextIO | None = None,
                 log_every_s: float = 10.0):
        self.follow = MetricsFollower(run_dir)
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.log_every_s = log_every_s
        self.t0 = time.monotonic()
        self._last_log = 0.0

    def line(self) -> str:
        f = self.follow
        f.poll()
        step = f.last("train_step") or {}
        ev = f.last("eval") or {}
        gens = f.all_last("generator")
        done = (step.get("step", -1) + 1) if step else 0
        bar_n = 10
        filled = int(bar_n * done / max(1, self.total))
        gen_rate = sum(g.get("tokens_per_s") or 0 for g in gens) if gens else None
        gen_idle = (sum(g.get("idle_frac") or 0 for g in gens) / len(gens)) if gens else None
        elapsed = int(time.monotonic() - self.t0)
        acc = f"{ev['accuracy']:.2f}@v{ev.get('version', '?')}" if ev else "-"
        return (f"step {done}/{self.total} [{'#' * filled}{'-' * (bar_n - filled)}] "
                f"reward {_num(step.get('reward_mean'))}  eval {acc}  tok/s {_rate(gen_rate)}  "
                f"stale {_num(step.get('staleness_mean'), '.1f')}/{step.get('staleness_max', '-')}  "
                f"idle T {_pct(step.get('trainer_idle_frac'))} G {_pct(gen_idle)}  "
                f"{elapsed // 60:02d}:{elapsed % 60:02d}")

    def update(self, force: bool = False) -> None:
        text = self.line()
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()
        elif force or now - self._last_log >= self.log_every_s:
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last_log = now

    def close(self) -> None:
        self.update(force=True)
        if self.tty:
            self.stream.write("\n")
