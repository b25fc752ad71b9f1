"""A whole `tokenflow train` whose run directory is on the loopback network filesystem (fuse.sshfs):
the orchestrator is killed with SIGKILL mid-run, trainer rank 0 restarts it from the log on the
mount and the run completes, and `tokenflow inspect` on the second mount (another client of the
export) matches the writer's counts.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from support.log_places import netfs_mounts
from pipeline.rollout_log.format import GroupOutcome, LogError
from pipeline.rollout_log.reader import RolloutLog
from pipeline.metrics import read_metrics

pytestmark = pytest.mark.engine

STEPS = 8  # long enough that the kill, seen through the other mount's lag, lands mid-run
ARGS = [f"run.steps={STEPS}", "run.eval_every=0", "run.checkpoint_every=4", "run.timeout_s=300",
        "run.progress=false", "logger=[]", "orchestrator.groups_per_step=4",
        "orchestrator.group_size=8"]


def _pids_of(run_dir: Path, module: str) -> list[int]:
    """Processes of this test's run (its run directory is unique) running ``module``."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        line = b" ".join(cmd)
        if p.name.isdigit() and module.encode() in line and str(run_dir).encode() in line:
            out.append(int(p.name))
    return out


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_train_on_network_fs_survives_kill9_of_the_orchestrator(tmp_path):
    mounts, why = netfs_mounts()
    if why:
        pytest.skip(why)
    name = f"netfs-{uuid.uuid4().hex[:8]}"
    run, seen_from_other_node = mounts[0] / name, mounts[1] / name
    cmd = [sys.executable, "-m", "pipeline.cli", "train", f"run.name={name}",
           f"hydra.run.dir={run}", *ARGS]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(cmd, stdout=open(tmp_path / "first.out", "w"),
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # a hang guard, not a performance bound
        state = None
        while time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.25)
            try:
                with RolloutLog.open(seen_from_other_node) as log:  # live, from the other mount
                    state = log.resume_state()
            except LogError:
                continue
            if state.last_step >= 0 and len(state.stored["group_id"]) >= 4:
                break
        assert state is not None and state.last_step >= 0, (tmp_path / "first.out").read_text()[-3000:]
        trained = len(list(read_metrics(run, "train_step")))
        # a kill after the trainer's last step tests nothing (it releases the orchestrator then)
        assert trained < STEPS - 1, f"the kill came after step {trained} of {STEPS}: the run is too short"
        orchestrators = _pids_of(run, "pipeline.apps.orchestrator")
        assert len(orchestrators) == 1
        os.kill(orchestrators[0], signal.SIGKILL)
        # trainer rank 0 restarts the orchestrator, which restores from the log on the mount
        assert first.wait(900) == 0, (tmp_path / "first.out").read_text()[-3000:]
    finally:
        _stop_group(first)
    before = state  # acknowledged (stored in the log) before the kill, read from the other mount
    restarts = [m.get("orchestrator_restarts", 0) for m in read_metrics(run, "train_step")]
    assert max(restarts) >= 1, "the orchestrator was not restarted"
    for _ in range(30):
        if not _pids_of(run, "pipeline"):
            break
        time.sleep(1.0)
    assert not _pids_of(run, "pipeline"), "a process of the run outlived it"

    inspect = subprocess.run([sys.executable, "-m", "pipeline.cli", "inspect",
                              str(seen_from_other_node), "--json"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert inspect.returncode == 0, inspect.stderr
    s = json.loads(inspect.stdout)
    with RolloutLog.open(run) as log:  # the writer's own mount
        st = log.resume_state()
        g = log.groups()
        n_tokens = int(log.column("samples/prompt_len").sum(dtype=np.int64)
                       + log.column("samples/completion_len").sum(dtype=np.int64))
    # the resumed orchestrator's own counts: its life writes a record even when the trainer's stop
    # reached it while it restored the log (the trainer may have held every step's batch at the kill)
    orch = list(read_metrics(run, "orchestrator"))[-1]
    assert s["groups"]["stored"] == st.counts["stored"] == (
        orch.get("count_stored", 0) + orch.get("count_restored_stored", 0)), (
        orch, (run / "logs" / "orchestrator.out").read_text()[-3000:])
    assert s["samples"] == st.num_samples and s["tokens"]["total"] == n_tokens
    assert s["steps"] == STEPS and s["last_step"] == STEPS - 1 and not s["problems"]
    assert st.duplicate_groups == 0
    stored = g["group_id"][g["outcome"] == GroupOutcome.STORED]
    assert len(stored) == len(np.unique(stored))
    assert set(before.stored["group_id"].tolist()) <= set(stored.tolist())  # nothing acked lost
    steps = [m["step"] for m in read_metrics(run, "train_step")]
    assert steps[-1] == STEPS - 1 and (run / "checkpoints" / f"step-{STEPS}" / "COMPLETE").exists()
    shutil.rmtree(run, ignore_errors=True)  # kept for a look when the test fails
