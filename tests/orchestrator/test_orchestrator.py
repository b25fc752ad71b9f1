"""The orchestrator as a process: real ZeroMQ sockets, real HDF5 log, synthetic producers.

Generators and the trainer here are `tests/support/loadgen.py` processes (the real engines are tested in
their own files); everything between them is the production code path.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pipeline.rollout_log.format import GroupOutcome
from pipeline.rollout_log.reader import RolloutLog
from pipeline.metrics import read_metrics
from pipeline.protocol.links import read_rendezvous
from pipeline.config import ReplayConfig, RunConfig, TokenflowConfig
from pipeline.orchestrator.config import OrchestratorConfig
from pipeline.run_dir import save_run_config
from pipeline.tasks import TaskConfig
from support.child_env import child_env

PY = sys.executable


def write_spec(run_dir: Path, replay_source: Path | None = None, **orch) -> None:
    """A run directory whose config asks for the synthetic data-plane task."""
    run_dir.mkdir(parents=True, exist_ok=True)
    values = {"group_size": 4, "groups_per_step": 4, "max_async": 1, "metrics_interval_s": 0.2,
              "lease_timeout_s": 5.0}
    values.update(orch)
    cfg = TokenflowConfig(run=RunConfig(name="t", dir=str(run_dir)),
                          task=TaskConfig(name="synthetic", eval_size=10),
                          orchestrator=OrchestratorConfig(**values),
                          replay=ReplayConfig(source=str(replay_source) if replay_source else None))
    save_run_config(run_dir, cfg)


LOADGEN = str(Path(__file__).parents[1] / "support" / "loadgen.py")


def start(args: list[str], log: Path) -> subprocess.Popen:
    """``args``: a module to run with ``-m`` and its arguments, or LOADGEN (a script) and its."""
    cmd = [PY, *args] if args[0] == LOADGEN else [PY, "-m", *args]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=child_env())


def start_orchestrator(run_dir: Path, tag: str = "0") -> subprocess.Popen:
    rv = run_dir / "rendezvous" / "orchestrator.json"
    before = rv.stat().st_mtime_ns if rv.exists() else None
    p = start(["pipeline.apps.orchestrator", str(run_dir)], run_dir / f"orch{tag}.log")
    deadline = time.monotonic() + 30
    while not (rv.exists() and rv.stat().st_mtime_ns != before):
        assert p.poll() is None, (run_dir / f"orch{tag}.log").read_text()
        assert time.monotonic() < deadline, "orchestrator did not publish its address"
        time.sleep(0.05)
    return p


def start_generator(run_dir: Path, gid: int, duration: float = 120, **kw) -> subprocess.Popen:
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    return start([LOADGEN, "generator", str(run_dir), f"--id={gid}",
                  f"--duration={duration}", *extra], run_dir / f"gen{gid}.log")


def wait_for_generators(run_dir: Path, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = list(read_metrics(run_dir, "orchestrator"))
        if m and m[-1]["generators"] >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{n} generators did not connect within {timeout}s")


def run_trainer(run_dir: Path, steps: int, start_step: int = 0, timeout: float = 60,
                step_time: float = 0.0, *extra: str) -> list[dict]:
    out = subprocess.run([PY, LOADGEN, "trainer", str(run_dir), f"--steps={steps}",
                          f"--start-step={start_step}", f"--timeout={timeout}",
                          f"--step-time={step_time}", *extra],
                         capture_output=True, text=True, env=child_env(), timeout=timeout * 3)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["steps"]


def stop(*procs: subprocess.Popen, sig=signal.SIGTERM) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def check_log_invariants(run_dir: Path, max_staleness: int) -> dict:
    """Exactly-once storage, a consistent step record and the staleness bound, from the log."""
    with RolloutLog.open(run_dir / "rollouts") as log:
        g = log.groups()
        stored = g["group_id"][g["outcome"] == GroupOutcome.STORED]
        assert len(stored) == len(np.unique(stored)), "a group was stored twice"
        sample_gids = log.column("samples/group_id")
        assert len(sample_gids) == 4 * len(stored)
        assert set(np.unique(sample_gids)) == set(stored.tolist())
        # each recorded step: groups_per_step whole groups, within the staleness bound
        mv = dict(zip(log.rows().tolist(), log.min_versions().tolist()))
        records = log.step_records()
        for step, tv, rows in records:
            assert len(rows) == 16
            stale = tv - min(mv[int(r)] for r in rows)
            assert stale <= max_staleness, f"step {step}: staleness {stale}"
        steps_rows = [r for _, _, r in records]
        consumed = np.concatenate(steps_rows) if steps_rows else np.zeros(0)
        last_by_step = {s: r for s, _, r in records}
        flat = np.concatenate(list(last_by_step.values())) if last_by_step else np.zeros(0)
        assert len(flat) == len(np.unique(flat)), "a sample was consumed by two steps"
        versions = np.unique(np.concatenate([b.columns["versions"] for b in log.iter_batches()]))
        return {"stored": stored, "resolved": g["group_id"], "steps": sorted(last_by_step),
                "versions": versions, "consumed": consumed}


def test_generators_and_trainer_run_through_the_orchestrator(tmp_path):
    write_spec(tmp_path)
    orch = start_orchestrator(tmp_path)
    gens = [start_generator(tmp_path, i) for i in range(2)]
    try:
        wait_for_generators(tmp_path, 2)
        steps = run_trainer(tmp_path, steps=8)
    finally:
        stop(*gens)
        stop(orch)
    assert [s["step"] for s in steps] == list(range(8))
    assert all(s["n"] == 16 for s in steps)
    # both generators got work (credits are granted round-robin)
    outs = [json.loads((tmp_path / f"gen{i}.log").read_text().strip().splitlines()[-1]) for i in range(2)]
    assert all(o["sent"] > 0 for o in outs), outs
    inv = check_log_invariants(tmp_path, max_staleness=1)
    assert inv["steps"] == list(range(8))
    assert len(np.unique(inv["versions"])) >= 2
    m = list(read_metrics(tmp_path, "orchestrator"))
    assert m and m[-1]["count_stored"] == len(inv["stored"]) and m[-1]["count_steps_recorded"] == 8
    assert all(r["kept"] + r["in_flight"] <= r["bound"] for r in m if r["version"] is not None)


def test_kill_9_mid_stream_then_resume_loses_and_duplicates_nothing(tmp_path):
    write_spec(tmp_path, lease_timeout_s=3.0)
    orch = start_orchestrator(tmp_path, "0")
    gens = [start_generator(tmp_path, i, min_len=200, max_len=400) for i in range(2)]
    try:
        run_trainer(tmp_path, steps=4)
        orch.send_signal(signal.SIGKILL)  # mid-stream: generators keep sending
        orch.wait()
        time.sleep(0.5)
        with RolloutLog.open(tmp_path / "rollouts") as log:
            before = log.groups()["group_id"][log.groups()["outcome"] == GroupOutcome.STORED]
        orch = start_orchestrator(tmp_path, "1")
        # the trainer restarts from "checkpoint" 3: step 3 is re-served from the step record
        again = run_trainer(tmp_path, steps=4, start_step=3)
        assert again[0]["step"] == 3
        orch.send_signal(signal.SIGKILL)
        orch.wait()
        orch = start_orchestrator(tmp_path, "2")
        run_trainer(tmp_path, steps=9, start_step=4)
        time.sleep(1.0)
    finally:
        stop(*gens)
        stop(orch)
    inv = check_log_invariants(tmp_path, max_staleness=1)
    assert set(before.tolist()) <= set(inv["stored"].tolist())
    assert inv["steps"] == list(range(9))
    # No admitted group lost: an id below the largest resolved one that is not resolved must be
    # one the last orchestrator still had in flight (it is re-issued on the next resume).
    resolved = set(inv["resolved"].tolist())
    gaps = set(range(max(resolved) + 1)) - resolved
    last = list(read_metrics(tmp_path, "orchestrator"))[-1]
    assert len(gaps) <= last["in_flight"], (gaps, last)
    assert last.get("count_duplicate", 0) + last.get("count_unleased", 0) >= 0
    with RolloutLog.open(tmp_path / "rollouts") as log:
        # each restart sealed its killed predecessor's journal; at most one segment per start
        assert 2 <= len(log.segments) <= 3


def test_trainer_resume_rolls_back_later_steps_and_evals_run_through_generators(tmp_path):
    write_spec(tmp_path, max_async=2)
    orch = start_orchestrator(tmp_path)
    gens = [start_generator(tmp_path, i) for i in range(2)]
    try:
        wait_for_generators(tmp_path, 2)
        first = run_trainer(tmp_path, 6, 0, 60, 0.0, "--eval-every=3")
        # the trainer "crashed" after its checkpoint at step 3: steps 3..5 are forgotten
        second = run_trainer(tmp_path, 6, 3, 60, 0.0, "--resume")
        time.sleep(0.5)
    finally:
        stop(*gens)
        stop(orch)
    assert [s["step"] for s in second] == [3, 4, 5]
    for rec in first + second:
        assert sum(rec["rank_sizes"]) == 16 and min(rec["rank_sizes"]) > 0
    for rec in second:  # no token from weights the restarted trainer never had
        assert rec["max_version"] <= rec["step"]
    inv = check_log_invariants(tmp_path, max_staleness=2)
    assert inv["steps"] == list(range(6))
    last = list(read_metrics(tmp_path, "orchestrator"))[-1]
    assert last["count_trainer_resumes"] == 1
    evals = list(read_metrics(tmp_path, "eval"))
    assert [e["step"] for e in evals] == [0, 3] and all(e["n"] == 10 for e in evals)
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in evals)


def test_replay_feeds_recorded_groups_in_order_once_across_a_crash(tmp_path):
    source = tmp_path / "source"
    write_spec(source)
    orch = start_orchestrator(source)
    gens = [start_generator(source, 0)]
    try:
        run_trainer(source, steps=6)
    finally:
        stop(*gens)
        stop(orch)
    with RolloutLog.open(source) as log:
        g = log.groups()
        recorded = g["group_id"][g["outcome"] == GroupOutcome.STORED][np.argsort(
            g["first_row"][g["outcome"] == GroupOutcome.STORED])].tolist()
    replay = tmp_path / "replay"
    write_spec(replay, replay_source=source, max_staleness=10**9)
    orch = start_orchestrator(replay, "0")
    try:
        run_trainer(replay, steps=3)
        orch.send_signal(signal.SIGKILL)
        orch.wait()
        orch = start_orchestrator(replay, "1")
        run_trainer(replay, 5, 1, 60, 0.0, "--resume")  # as the restarted trainer, from checkpoint 1
    finally:
        stop(orch)
    with RolloutLog.open(replay) as log:
        g = log.groups()
        # recorded versions belong to the source run: the replay trainer's rollback drops nothing
        assert not (g["outcome"] == GroupOutcome.DROPPED_ROLLBACK).any()
        fed = g["group_id"][g["outcome"] == GroupOutcome.STORED]
        assert len(fed) == len(set(fed.tolist())), "a recorded group was fed twice"
        assert fed.tolist() == recorded[:len(fed)], "groups were not fed in recorded order"
        assert len(fed) >= 5 * 4
        latest = {step: rows for step, _, rows in log.step_records()}  # steps 1, 2 recorded twice
        consumed = sorted(int(r) for rows in latest.values() for r in rows)
    assert sorted(latest) == list(range(5)) and len(consumed) == len(set(consumed)) == 5 * 16

    def per_sample(log):
        return {(int(b.columns["group_id"][i]), int(b.columns["sample_index"][i])):
                (float(b.columns["reward"][i]), b.tokens("logprobs", i).tobytes())
                for b in log.iter_batches() for i in range(len(b))}

    with RolloutLog.open(source) as src, RolloutLog.open(replay) as rep:
        original, replayed = per_sample(src), per_sample(rep)
    assert replayed and all(original[k] == v for k, v in replayed.items()), \
        "replay changed a recorded reward or behaviour logprob"


def test_a_restarted_orchestrator_counts_kept_groups_as_if_it_never_stopped(tmp_path):
    """Regression: admission's ``kept`` after a restart equals the count the stopped incarnation
    reached (every kept group since the run began, consumed ones included), not the buffer size."""
    write_spec(tmp_path)
    orch = start_orchestrator(tmp_path, "0")
    gens = [start_generator(tmp_path, i) for i in range(2)]
    try:
        run_trainer(tmp_path, steps=4)
        stop(*gens)
        stop(orch)  # SIGTERM: the last metric line is written after the final flush
        first = list(read_metrics(tmp_path, "orchestrator"))
        orch = start_orchestrator(tmp_path, "1")  # its first metric line is the restored state
        deadline = time.monotonic() + 30
        while len(list(read_metrics(tmp_path, "orchestrator"))) <= len(first):
            assert time.monotonic() < deadline, "the restarted orchestrator wrote no metrics"
            time.sleep(0.05)
    finally:
        stop(*gens)
        stop(orch)
    before, restored = first[-1], list(read_metrics(tmp_path, "orchestrator"))[len(first)]
    with RolloutLog.open(tmp_path / "rollouts") as log:
        g = log.groups()
        stored = set(g["group_id"][g["outcome"] == GroupOutcome.STORED].tolist())
        evicted = set(g["group_id"][g["outcome"] == GroupOutcome.EVICTED_STALE].tolist())
    assert restored["kept"] == before["kept"] == len(stored) - len(evicted), (before, restored)
    assert restored["kept"] >= 16 + restored["buffer_groups"]  # 4 consumed steps of 4 groups


def _catches(pid: int, sig: int) -> bool:
    """The process has a handler for ``sig`` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_a_stop_during_start_up_is_taken_after_it_with_the_restored_counts_written(tmp_path):
    """Regression (CI, stop 42): the trainer's stop reached a restarted orchestrator while it was
    still restoring the log; it died there without a metrics record, so the run's last record was
    its killed predecessor's. A stop during start-up now ends the new life after a whole start."""
    write_spec(tmp_path)
    orch = start_orchestrator(tmp_path, "0")
    gens = [start_generator(tmp_path, i) for i in range(2)]
    try:
        run_trainer(tmp_path, steps=2)
    finally:
        stop(*gens)
        stop(orch)
    with RolloutLog.open(tmp_path / "rollouts") as log:
        stored = int((log.groups()["outcome"] == GroupOutcome.STORED).sum())
    rv = tmp_path / "rendezvous" / "orchestrator.json"
    published = rv.stat().st_mtime_ns
    lives = len(list((tmp_path / "metrics").glob("orchestrator-*.jsonl")))
    second = start(["pipeline.apps.orchestrator", str(tmp_path)], tmp_path / "orch1.log")
    deadline = time.monotonic() + 30
    while not _catches(second.pid, signal.SIGTERM):
        assert second.poll() is None and time.monotonic() < deadline, (tmp_path / "orch1.log").read_text()
        time.sleep(0.005)
    second.send_signal(signal.SIGTERM)
    assert rv.stat().st_mtime_ns == published, "the stop came after start-up: nothing was tested"
    assert second.wait(60) == 0, (tmp_path / "orch1.log").read_text()
    files = sorted((tmp_path / "metrics").glob("orchestrator-*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) == lives + 1
    last = [json.loads(line) for line in files[-1].read_text().splitlines()][-1]
    assert last["count_restored_stored"] == stored > 0 and last.get("count_stored", 0) == 0
