"""Helpers of the kill -9 tests (local and Slurm): find a run's processes, kill them at seeded steps,
measure the recovery, check the run's record.

Processes are found by what they are, never by a global name match: a role process's command line
holds the run directory and its environment the task's global rank (`TOKENFLOW_GLOBAL_RANK`) and
`TOKENFLOW_ROLE_PROCESS`; the orchestrator's command line holds the run directory; an engine
(``VLLM::EngineCore``) is a descendant of its generator's role process.
"""
from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline.rollout_log.format import GroupOutcome
from pipeline.rollout_log.reader import RolloutLog
from pipeline.metrics import read_metrics
from pipeline.supervise import descendants


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _environ(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []


def role_process(run_dir: Path, global_rank: int) -> int | None:
    """pid of the role process (not its supervisor) of task ``global_rank`` of the run."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if str(run_dir) not in _cmdline(pid) or "pipeline.apps.launch_task" not in _cmdline(pid):
            continue
        env = _environ(pid)
        if f"TOKENFLOW_GLOBAL_RANK={global_rank}" in env and any(e.startswith("TOKENFLOW_ROLE_PROCESS=") for e in env):
            return pid
    return None


def orchestrator_process(run_dir: Path) -> int | None:
    for name in os.listdir("/proc"):
        if name.isdigit() and f"pipeline.apps.orchestrator {run_dir}" in _cmdline(int(name)):
            return int(name)
    return None


def engine_process(run_dir: Path, global_rank: int) -> int | None:
    role = role_process(run_dir, global_rank)
    if role is None:
        return None
    return next((p for p in descendants(role) if "EngineCore" in _cmdline(p)), None)


def loaded_after_restart(run_dir: Path, role: str, rank: int, restart: int) -> bool:
    """True once the role process of ``role.rank`` started for the ``restart``-th time loaded weights."""
    text = (Path(run_dir) / "logs" / f"{role}.{rank}.out").read_text(errors="replace")
    _, _, after = text.partition(f"(restart {restart})")
    return "loaded version" in after


def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in read_metrics(run_dir, "train_step")), default=-1)


def wait_for(predicate, timeout: float, what: str, running: Callable[[], bool] | None = None):
    """Poll ``predicate`` until it is truthy (returns its value); fail after ``timeout`` s, or at once
    once ``running()`` says the run ended (its logs then say why)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if running is not None and not running():
            raise AssertionError(f"the run ended while waiting for {what}")
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@dataclass
class Kill:
    target: str  # "orchestrator", "generator", "engine", "trainer"
    at_step: int
    pid: int = 0
    t: float = 0.0  # unix time of the kill
    step: int = -1  # last finished step at the kill


@dataclass
class Chaos:
    """Seeded kill steps: ``targets`` in order, each a random 1..spread steps after the previous."""

    run_dir: Path
    targets: list[str]
    seed: int = field(default_factory=lambda: int(os.environ.get("TOKENFLOW_CHAOS_SEED", random.randrange(10**6))))
    first: int = 2
    spread: int = 2
    running: Callable[[], bool] | None = None  # False once the run ended: waits for it fail at once
    kills: list[Kill] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        step = self.first
        for target in self.targets:
            self.kills.append(Kill(target, step))
            step += 1 + rng.randrange(self.spread)
        print(f"chaos seed {self.seed} (TOKENFLOW_CHAOS_SEED): "
              + ", ".join(f"kill -9 {k.target} after step {k.at_step}" for k in self.kills), flush=True)

    def strike(self, kill: Kill, find, timeout: float = 600) -> Kill:
        """Wait for ``kill.at_step`` to be trained, then SIGKILL the process ``find()`` names (as soon
        as it names one: a restarted process may need a while)."""
        wait_for(lambda: last_step(self.run_dir) >= kill.at_step, timeout, f"step {kill.at_step}", self.running)
        kill.pid = wait_for(find, timeout, f"the {kill.target} process", self.running)
        kill.step = last_step(self.run_dir)
        kill.t = time.time()
        os.kill(kill.pid, signal.SIGKILL)
        print(f"killed {kill.target} pid {kill.pid} after step {kill.step}", flush=True)
        return kill

    def recovery(self, kill: Kill) -> dict:
        """Seconds from the kill to the first step finished after it; groups wasted meanwhile: leased
        again (work lost with the dead process) or results refused, from the orchestrator's counters,
        which a restarted orchestrator starts again from 0 (then all it counted is after the kill)."""
        after = [r for r in read_metrics(self.run_dir, "train_step") if r["t"] > kill.t]
        orch = list(read_metrics(self.run_dir, "orchestrator"))
        before = [r for r in orch if r["t"] <= kill.t]
        later = [r for r in orch if after and r["t"] >= after[0]["t"]]
        wasted = None
        if before and later:
            restarted = any(kill.t <= t <= later[0]["t"] for t in orchestrator_starts(self.run_dir))
            wasted = sum(later[0].get(k, 0) - (0 if restarted else before[-1].get(k, 0))
                         for k in ("reissued", "count_unleased"))
        return {"target": kill.target, "killed_after_step": kill.step,
                "to_training_s": round(after[0]["t"] - kill.t, 1) if after else None, "wasted_groups": wasted}


def orchestrator_starts(run_dir: Path) -> list[float]:
    """Unix times at which an orchestrator process of the run started serving (its log's first line)."""
    starts = []
    for line in (Path(run_dir) / "logs" / "orchestrator.out").read_text(errors="replace").splitlines():
        if " orchestrator INFO orchestrator epoch " in line:
            stamp, _, ms = line[:23].partition(",")
            starts.append(time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000)
    return starts


def check_record(run_dir: Path, steps: int, max_staleness: int) -> None:
    """Every step trained once in the end, no group stored twice, none lost, staleness in bound."""
    records = list(read_metrics(run_dir, "train_step"))
    assert sorted({r["step"] for r in records}) == list(range(steps))
    assert max(r["staleness_max"] for r in records) <= max_staleness
    with RolloutLog.open(run_dir) as log:
        g = log.groups()
        stored = g["group_id"][g["outcome"] == GroupOutcome.STORED]
        assert len(stored) == len(np.unique(stored)), "a group was stored twice"
        assert sorted(log.resume_state().step_rows) == list(range(steps))
        resolved = set(g["group_id"].tolist())
    gaps = set(range(max(resolved) + 1)) - resolved
    last = list(read_metrics(run_dir, "orchestrator"))[-1]
    assert len(gaps) <= last["in_flight"], f"admitted groups {sorted(gaps)[:10]} neither stored nor in flight"
