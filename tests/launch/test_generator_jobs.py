"""Generators that join a running run from their own job and leave it (`tokenflow generators`).

Local run, real engines, trainer and launcher: the run starts with one generator; a second joins
through ``tokenflow generators RUN --count 1`` (its own detached job, rank allocated in the run
directory), gets leases, and its tokens carry versions at least the one the trainer had when it
joined; its job is then stopped with SIGTERM (as scancel would) mid-run. The run completes with
every step trained once, no group lost or stored twice; the joins, the departure and both
regroups are in the metrics stream, and the trainer's wait on either event, beyond its usual wait,
is at most one step.
"""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from support.chaos import check_record, last_step, wait_for
from pipeline.launch.rendezvous import free_port
from pipeline.rollout_log.reader import RolloutLog
from pipeline.metrics import read_metrics
from pipeline.supervise import alive

REPO = Path(__file__).resolve().parents[2]
STEPS = 2000  # 0.2-1.2 s each: the joiner's engine starts while the run goes on, at nice 10 on the
# trainer's core 151-205 s from submission to first lease (1.5-3 min as an equal); on a quiet machine
# 250 steps ended before the join, with 700 it joined at step 638, and 1000 ended before a nice joiner
GROUPS_PER_STEP = 4  # 8 made steps of about 1 s, not the few seconds hoped for, and the events' 1 s
# blips stayed (bench/results/2026-12-02-generator-jobs-runs.md, run 5)


def _membership(run: Path, event: str, gid: int | None = None) -> list[dict]:
    return [r for r in read_metrics(run, "membership") if r["event"] == event
            and (gid is None or r["generator_id"] == gid)]


QUIET_PERCENTILE = 95
"""The trainer's usual worst wait over n steps: this percentile of the longest ``wait_s + sync_s`` in
each run of n consecutive event-free steps (n: the steps the event is charged with)."""


def event_steps(run: Path, t: float, after_switch: int = 3) -> tuple[list[dict], dict, dict]:
    """The step records an event at unix time ``t`` may have cost: from the event until
    ``after_switch`` steps after the trainer switched to the weight group the event caused (the
    first regroup after ``t``: it starts forming; the ``switch`` record: the first version announced
    into it, or a later group), so a joiner's first broadcasts and first leased steps are in; with
    that regroup and switch record."""
    regroup = next(r for r in _membership(run, "regroup") if r["t"] >= t)
    switch = next((r for r in _membership(run, "switch") if r["epoch"] >= regroup["epoch"]), regroup)
    steps = list(read_metrics(run, "train_step"))
    after = next(i for i, r in enumerate(steps) if r["t"] >= switch["t"])
    return [r for r in steps[:after + 1 + after_switch] if r["t"] >= t] or [steps[after]], regroup, switch


def waited_since(r: dict, t: float) -> float:
    """Of step record ``r``'s ``wait_s + sync_s``, the part after unix time ``t``: the record is
    written after the push, so ``sync_s`` ends at ``r["t"]``, the train step (``step_s``) before
    it, the wait for the batch before that (a checkpoint between push and record only moves them
    later, so it counts more, never less). A wait that ended before the event is not its cost."""
    sync_from = r["t"] - r["sync_s"]
    wait_to = sync_from - r["step_s"]
    return min(r["sync_s"], max(0.0, r["t"] - t)) + max(0.0, wait_to - max(t, wait_to - r["wait_s"]))


def usual_worst_wait(steps: list[dict], costed: set[int], n: int) -> float:
    """`QUIET_PERCENTILE` of the longest ``wait_s + sync_s`` in each run of ``n`` consecutive steps
    none of which an event may have cost (``costed``), after the first 10 (the run's first group and
    engine steps)."""
    waits = [(r["step"] not in costed, r["wait_s"] + r["sync_s"]) for r in steps[10:]]
    worst = [max(w for _, w in waits[i:i + n]) for i in range(len(waits) - n + 1)
             if all(quiet for quiet, _ in waits[i:i + n])]
    return float(np.percentile(worst, QUIET_PERCENTILE))


def trainer_wait_after(run: Path, t: float, other_events: tuple[float, ...] = ()) -> dict:
    """The trainer's wait on an event at unix time ``t``: the longest ``wait_s + sync_s`` of its
    `event_steps` after ``t`` (`waited_since`), against the trainer's usual worst wait over as many
    steps without any event (`usual_worst_wait`; ``t`` and ``other_events`` may have cost theirs),
    and one step (median gap between step records). ``excess_s`` (the check: at most one step) is
    the event's wait beyond that usual worst.

    Like against like: the event's figure is the longest of n waits, so it is compared with the
    longest of n event-free waits. On a 2-core machine the sum jumps by about a step on steps
    without any event; against the median of single steps (the first check), then their 95th
    percentile (runs 1-20), the noise still decided: up to 5 % of the runs of 4 event-free steps in
    four 1000-step runs would have failed the latter, and the two joins it failed by 0.03 s came
    within 0.06-0.09 s of the 95th percentile of 5-step maxima. What this check still fails
    (docs/generator-jobs.md, runs 16-22): a joiner sharing the trainer's core as an equal (+0.30 s,
    one step 0.21 s), a departure whose worker outlived its SIGTERM (+5.86 s), and a trainer waiting
    for a cold engine (2-69 s)."""
    steps = list(read_metrics(run, "train_step"))
    covered, regroup, switch = event_steps(run, t)
    costed = {r["step"] for e in (t, *other_events) for r in event_steps(run, e)[0]}
    worst = max(covered, key=lambda r: waited_since(r, t))
    usual = usual_worst_wait(steps, costed, len(covered))
    one_step = statistics.median(b["t"] - a["t"] for a, b in zip(steps, steps[1:]))
    waited = waited_since(worst, t)
    quiet = [r["wait_s"] + r["sync_s"] for r in steps[10:] if r["step"] not in costed]
    return {"regroup_epoch": regroup["epoch"], "steps": [covered[0]["step"], covered[-1]["step"]],
            "switch_after_s": round(switch["t"] - regroup["t"], 2), "worst_step": worst["step"],
            "wait_s": round(waited, 2), "sync_s": round(worst["sync_s"], 2),
            "median_wait_s": round(statistics.median(quiet), 2), "usual_worst_s": round(usual, 2),
            "excess_s": round(waited - usual, 2), "one_step_s": round(one_step, 2)}


def join_then_leave(run: Path, running, add_args: list[str], stop_job, steps: int, jobs: list) -> dict:
    """Add one generator by ``tokenflow generators RUN --count 1 ADD_ARGS`` once the run's first
    weight group is built (so the join is a mid-run regroup; the joiner's engine start, 1-2 minutes
    on a busy 2-core machine, overlaps the run's steps), wait until it generated and 3 more steps went by, check ``tokenflow status``, stop its job with
    ``stop_job(record)`` (SIGTERM as scancel sends) and wait for its departure. The job's record
    goes to ``jobs`` as soon as it exists (for the caller's clean-up). Returns the facts the checks
    after the run need."""
    from pipeline.launch.generator_jobs import job_records

    wait_for(lambda: _membership(run, "regroup"), 600, "the run's first weight group", running)
    t_submit = time.time()
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "generators", str(run), "--count", "1", *add_args],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    (job,) = job_records(run)
    jobs.append(job)
    assert (job["job"], job["first_rank"], job["count"]) == ("genjob-0", 1, 1), job
    joined = wait_for(lambda: _membership(run, "join", 1), 600, "generator 1 to join", running)[0]
    first_work = wait_for(lambda: [r for r in read_metrics(run, "generator")
                                   if r["generator_id"] == 1 and r["tokens"] > 0], 300,
                          "generator 1 to generate", running)[0]
    at_join = [r["version"] for r in read_metrics(run, "train_step") if r["t"] <= joined["t"]]
    assert _membership(run, "join", 0)[0]["t"] < joined["t"] and _membership(run, "regroup")[0]["t"] < joined["t"], \
        "the joiner was not the second generator (a join into the run's first weight group is no mid-run join)"
    step_at_join = last_step(run)
    wait_for(lambda: last_step(run) >= step_at_join + 3, 300, "3 steps with two generators", running)
    status = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", str(run), "--json"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    jobs = json.loads(status.stdout)["generator_jobs"]
    assert [j["job"] for j in jobs] == ["run", "genjob-0"] and jobs[1]["state"] == "RUNNING", jobs
    assert jobs[1]["generators"][0]["rank"] == 1 and jobs[1]["generators"][0]["version"] is not None, jobs
    t_leave = time.time()
    stop_job(job)
    left = wait_for(lambda: _membership(run, "leave", 1), 120, "generator 1 to leave", running)[0]
    assert last_step(run) < steps - 2, "the run ended too soon to train after the departure"
    return {"job": job, "t_submit": t_submit, "joined": joined, "first_work": first_work, "left": left,
            "t_leave": t_leave, "version_at_join": at_join[-1] if at_join else 0}


def check_and_report(run: Path, facts: dict, steps: int, max_staleness: int, killed_after_leave: bool = False) -> dict:
    """After the run: exactly-once record, the joiner's stored tokens of current versions, and the
    trainer's wait on the join and on the departure (at most one step beyond its usual wait).
    ``killed_after_leave``: its scheduler SIGKILLs the joiner's task KillWait seconds after the
    SIGTERM (Slurm; 3 s on the test cluster), which may come before the orchestrator's Stop let the
    role return: then there is no result, but there must be no failed one."""
    result_file = run / "results/generator.1.json"
    check_record(run, steps, max_staleness=max_staleness)
    if result_file.exists() or not killed_after_leave:
        result = json.loads(result_file.read_text())
        assert result["ok"], result
    with RolloutLog.open(run) as log:
        rows = log.rows()[log.column("samples/generator_id") == 1]
        assert len(rows) > 0, "the joined generator's groups were not stored"
        batch = log.read(rows)
    versions = batch.columns["versions"]  # every token of theirs (flat)
    loaded = [int(v) for v in re.findall(r"loaded version (\d+)", (run / "logs/generator.1.out").read_text())]
    assert loaded and loaded[0] >= facts["version_at_join"], (loaded, facts["version_at_join"])  # never older weights
    assert int(versions.min()) >= loaded[0], (int(versions.min()), loaded[0])
    left = facts["left"]
    assert left["members"] == 1, left
    report = {"submit_to_first_lease_s": round(facts["first_work"]["t"] - facts["t_submit"], 1),
              "join_wait": trainer_wait_after(run, facts["joined"]["t"], (left["t"],)),
              "leave_wait": trainer_wait_after(run, left["t"], (facts["joined"]["t"],)),
              "leases_returned": left["leases_returned"],
              "sigterm_to_leave_s": round(left["t"] - facts["t_leave"], 2),
              "joined_groups_stored": int(len(np.unique(batch.columns["group_id"]))),
              "joined_token_versions": [int(versions.min()), int(versions.max())]}
    print("generator-jobs " + json.dumps(report), flush=True)
    for event in ("join_wait", "leave_wait"):
        assert report[event]["excess_s"] <= report[event]["one_step_s"], report
    return report


@pytest.mark.engine
@pytest.mark.slow  # 404 s at 250 steps on a busy 2-core machine; 1000 steps: 4-7 min on a quiet one; 2000: 614 s
def test_a_generator_job_joins_gets_leases_and_leaves_mid_run(tmp_path):
    from test_weight_recovery import compose

    from pipeline.apps.train import job_plan, prepare_run_dir
    from pipeline.launch import LocalLauncher

    run = tmp_path / "run"
    cfg = compose(run, "run.name=genjobs", f"run.steps={STEPS}", "run.eval_every=0", "run.mismatch_every=0",
                  "run.progress=false", "logger=[]", "run.checkpoint_every=100",
                  "cluster.generators=1", f"orchestrator.groups_per_step={GROUPS_PER_STEP}", "orchestrator.group_size=8",
                  "run.timeout_s=300", "generator.weight_timeout_s=60")
    prepare_run_dir(cfg)
    launched = LocalLauncher().launch(job_plan(cfg, run), run)
    jobs: list[dict] = []

    def stop_job(job: dict) -> None:
        os.killpg(job["pids"][0], signal.SIGTERM)  # the task's process group, engine included: as scancel

    try:
        facts = join_then_leave(run, lambda: launched.state() == "RUNNING", [], stop_job, STEPS, jobs)
        wait_for(lambda: not any(alive(p) for p in jobs[0]["pids"]), 120, "the generator job to exit")
        launched.wait(timeout_s=900)
    finally:
        for pid in (p for job in jobs for p in job["pids"]):
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)
        if not launched.done():
            launched.cancel()
    check_and_report(run, facts, STEPS, cfg.orchestrator.staleness_limit())


def start_slurm_run(run: Path, steps: int, *overrides: str) -> subprocess.Popen:
    """`tokenflow train` of a tiny run as one heterogeneous Slurm job, in the background."""
    from support.slurm_runs import TINY

    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", f"run.name={run.name}",
                             f"hydra.run.dir={run}", f"run.steps={steps}", "run.checkpoint_every=100",
                             "run.mismatch_every=0", *TINY, "generator.weight_timeout_s=60", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)


@pytest.mark.slurm
@pytest.mark.engine
@pytest.mark.slow  # 373 s here (200 steps; 730 s with cpu_plan=none): like the local one, plus scheduling
def test_a_generator_job_joins_and_leaves_a_slurm_run(tmp_path):
    """The same on the Slurm test cluster: the run is one heterogeneous job, the generator job a
    second job (on a node with room beside the trainer), cancelled with scancel."""
    from support.slurm_runs import status_of

    # 400 steps: with the core plan a step takes 0.4-1.8 s and the joiner's first lease came 69-320 s
    # after its submission as an equal on the trainer's core (of 100 steps one run ended before
    # the joiner had 3 steps); at nice 10 (cluster.joined_generator_nice) it starts slower
    run, steps = tmp_path / "sl", 400
    # The test cluster's nodes are one 2-core machine and its Slurm binds no task to cores
    # (TaskPlugin=task/none): with cpu_plan=none every vLLM engine binds its worker to core 0, the
    # joiner's beside the busy generator 0's, and the trainer's first broadcast into the group
    # with the joiner waited 4-60 s for it (docs/generator-jobs.md). The core plan places them
    # as locally (the generator job inherits it from the run).
    proc = start_slurm_run(run, steps, "cluster.cpu_plan=auto")
    jobs: list[dict] = []

    def stop_job(job: dict) -> None:
        subprocess.run(["scancel", str(job["job_id"])], check=True, timeout=30)

    add = ["cluster=slurm", "cluster.generator.cpus_per_task=2", "cluster.generator.mem_gb=0.5",
           "cluster.generator.time_min=20"]
    try:
        facts = join_then_leave(run, lambda: proc.poll() is None, add, stop_job, steps, jobs)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run([sys.executable, "-m", "pipeline.cli", "cancel", str(run)], timeout=30, cwd=REPO)
        for job in jobs:
            subprocess.run(["scancel", str(job["job_id"])], timeout=30)
    assert proc.returncode == 0, out[-4000:]
    final = status_of(run)
    assert final["complete"] and final["generator_jobs"][1]["state"] in ("CANCELLED", "COMPLETED"), final
    check_and_report(run, facts, steps, max_staleness=1, killed_after_leave=True)


@pytest.mark.slurm
@pytest.mark.engine
@pytest.mark.slow  # 536 s here: a run of 100 steps, the generator job's 4-minute time limit
def test_a_generator_job_at_its_time_limit_departs_for_good(tmp_path):
    """A Slurm generator job with a 4-minute time limit (Slurm's checkpoint signal comes 90 s before
    it) departs for good: it is never requeued (one row in ``sacct -D``, one attempt in its log,
    gone from the queue), its state COMPLETED or, when its task was still ending at the limit,
    TIMEOUT. Once its engine is up its generator leaves the run (a ``generator_leave`` record, its
    result ok and stopped; on a machine too busy to start the engine before the limit there is
    neither). The run completes without it, every step trained once."""
    from pipeline.launch.generator_jobs import job_records
    from pipeline.launch.slurm import ACTIVE_STATES

    run, steps = tmp_path / "tl", 100
    proc = start_slurm_run(run, steps)
    job_id = None

    def state() -> str:  # sacct's, not squeue's: squeue may answer nothing while slurmctld is busy
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                             text=True, timeout=30).stdout.split()
        return out[0] if out else "UNKNOWN"

    try:
        running = lambda: proc.poll() is None  # noqa: E731
        wait_for(lambda: _membership(run, "regroup"), 600, "the run's first weight group", running)
        out = subprocess.run([sys.executable, "-m", "pipeline.cli", "generators", str(run), "--count", "1",
                              "cluster=slurm", "cluster.generator.cpus_per_task=2", "cluster.generator.mem_gb=0.5",
                              "cluster.generator.time_min=4"], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0, out.stderr
        job_id = str(job_records(run)[0]["job_id"])
        wait_for(lambda: state() not in (*ACTIVE_STATES, "UNKNOWN"), 420, "the generator job to end at its time limit",
                 running)
        time.sleep(20)  # a requeue would show within seconds (AuthInfo cred_expire=10 on the test cluster)
        again = state()
        rows = subprocess.run(["sacct", "-n", "-X", "-P", "-D", "-j", job_id, "-o", "JobID,State,ElapsedRaw"],
                              capture_output=True, text=True, timeout=30).stdout.split()
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run([sys.executable, "-m", "pipeline.cli", "cancel", str(run)], timeout=30, cwd=REPO)
        if job_id:
            subprocess.run(["scancel", job_id], timeout=30)
    assert proc.returncode == 0, out[-4000:]
    assert again not in ACTIVE_STATES, f"the generator job came back: {again}"
    assert len(rows) == 1, f"requeued (sacct -D lists every run of the job): {rows}"
    job, state, elapsed = rows[0].split("|")
    log = (run / "logs/generator.1.out").read_text()
    assert log.count("=== generator.1 attempt") == 1, log[-3000:]
    assert state in ("COMPLETED", "TIMEOUT") and "SIGUSR2 received" in log, (rows, log[-3000:])
    left = [r for r in read_metrics(run, "generator_leave") if r["generator_id"] == 1]
    if left:
        result = json.loads((run / "results/generator.1.json").read_text())
        assert result["ok"] and result["stopped"], result
    check_record(run, steps, max_staleness=1)
    print("generator-jobs time limit " + json.dumps({"state": state, "elapsed_s": int(elapsed),
                                                     "left": bool(left)}), flush=True)


def test_a_generator_job_is_requeued_only_when_asked(tmp_path):
    """The job's plan: without --requeue it departs at its time limit (no requeue by submitit, its
    tasks end after their role); with it, the run's cluster.max_requeues apply."""
    from dataclasses import replace

    from pipeline.config import TokenflowConfig
    from pipeline.launch.generator_jobs import job_plan
    from pipeline.launch.task import REQUEUES

    run = tmp_path / "run"
    cfg = TokenflowConfig()
    cfg = replace(cfg, cluster=replace(cfg.cluster, max_requeues=5))
    plain = job_plan(cfg, run, 1, 1, 0, {"launcher": "local", "pids": [1]})
    asked = job_plan(cfg, run, 1, 1, 0, {"launcher": "local", "pids": [1]}, requeue=True)
    assert (plain.max_requeues, plain.config[REQUEUES]) == (0, False)
    assert (asked.max_requeues, asked.config[REQUEUES]) == (5, True)


def test_a_leaving_generator_returns_its_leases_at_once_and_is_stopped_after_the_member_list(tmp_path):
    """A real orchestrator process and the real links over ZeroMQ: a generator holding leases
    says Leave -> its leases are released (counted in the membership record) and it is no member;
    a credit update it sends later does not make it one again; it hears Stop only after the trainer
    listed the members (so no broadcast the trainer started before that can miss it)."""
    from test_orchestrator import start_orchestrator, stop, write_spec

    from pipeline.config import record_schema
    from pipeline.protocol import messages as m
    from pipeline.protocol.links import GeneratorLink, TrainerLink, WorkItem
    from pipeline.run_dir import load_run_config

    run = tmp_path / "run"
    write_spec(run)
    orch = start_orchestrator(run)
    schema = record_schema(load_run_config(run))
    try:
        trainer = TrainerLink(run, schema, timeout_s=10)
        stays, leaves = (GeneratorLink(run, gid, slots=3, schema=schema, timeout_s=10, job=job)
                         for gid, job in ((0, ""), (7, "genjob-0")))
        trainer.report_version(0)
        held: list[WorkItem] = []
        deadline = time.monotonic() + 30
        while len(held) < 3 and time.monotonic() < deadline:  # wants go out with each poll
            for link in (stays, leaves):
                link.loaded_version = 0
                items = link.poll(0.05)
                if link is leaves:
                    held += [i for i in items if isinstance(i, WorkItem)]
        assert len(held) == 3, "the generator got no leases"
        assert set(trainer.members(10)) == {"gen-0", "gen-7"}
        leaves.leave()
        left = wait_for(lambda: _membership(run, "leave", 7), 20, "the leave record")[0]
        assert left["leases_returned"] == 3 and left["members"] == 1, left
        assert [r["job"] for r in _membership(run, "join", 7)] == ["genjob-0"]
        leaves.send(m.Want(m.Credit(3, 3, None, 0)))  # late: must not re-adopt it
        assert not any(isinstance(i, m.Stop) for i in _drain(leaves, 1.0)), "stopped before the member list"
        assert set(trainer.members(10)) == {"gen-0"}
        assert any(isinstance(i, m.Stop) for i in _drain(leaves, 5.0)), "no Stop after the member list"
        assert set(trainer.members(10)) == {"gen-0"}
        # the returned groups are leased again: the staying generator gets them
        again = set()
        deadline = time.monotonic() + 30
        while not {i.group_id for i in held} <= again and time.monotonic() < deadline:
            again |= {i.group_id for i in stays.poll(0.05) if isinstance(i, WorkItem)}
            stays.active.clear()  # frees its slots (results are not the point here)
        assert {i.group_id for i in held} <= again, (held, again)
    finally:
        stop(orch)


def _drain(link, seconds: float) -> list:
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        out += link.poll(0.05)
    return out


def test_generator_ranks_are_unique_across_jobs_and_tasks_find_theirs():
    from pipeline.launch.generator_jobs import next_first_rank
    from pipeline.launch.plan import ComponentSpec, JobPlan
    from pipeline.launch.task import locate

    records = []
    for count in (2, 1, 3):
        records.append({"first_rank": next_first_rank(2, records), "count": count})
    ranks = [r for rec in records for r in range(rec["first_rank"], rec["first_rank"] + rec["count"])]
    assert ranks == [2, 3, 4, 5, 6, 7]  # after the run's generators 0, 1; none twice
    plan = JobPlan(components={"generator": ComponentSpec(entry="m:f", tasks_per_node=3, first_rank=5,
                                                          gpus_per_node=6)})
    plan.validate()
    assert plan.task_layout() == [("generator", 5), ("generator", 6), ("generator", 7)]
    assert locate(plan, {"SLURM_PROCID": "1"}) == (1, "generator", 6)
    from pipeline.launch.gpus import local_gpus
    assert local_gpus(plan.components["generator"], 6, [str(i) for i in range(6)]) == ["2", "3"]  # 2nd of its node


def test_a_generator_logs_its_stacks_at_sigterm_and_still_stops(tmp_path):
    """The generator role's SIGTERM stack dump (C level, chained) keeps the task's stop signal
    working: a process with both handlers, sent SIGTERM, has ``stop_requested`` set and its main
    thread's stack in its stderr; without the chain it would only dump."""
    code = ("import os, signal, threading\n"
            "from pipeline.launch.task import StopWatcher\n"
            "from pipeline.roles.generator import log_stacks_at_sigterm\n"
            "stop = threading.Event()\n"
            "StopWatcher(stop)\n"
            "log_stacks_at_sigterm()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('stop_requested', stop.wait(10), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert "stop_requested True" in out.stdout, (out.stdout, out.stderr)
    assert "SIGTERM received" in out.stdout, out.stdout
    assert "Current thread" in out.stderr and 'File "<string>", line 7' in out.stderr, out.stderr


GROUP_SWITCH_SENDER = """
import sys, torch
from pipeline.weights.group import TorchDistChannel
from pipeline.weights.group_build import GroupBuild
old_port, new_port = int(sys.argv[1]), int(sys.argv[2])
old = TorchDistChannel("127.0.0.1", old_port, 0, 2, timeout_s=30, epoch=1, secret=bytes(32))
new = GroupBuild(2, None, lambda: TorchDistChannel("127.0.0.1", new_port, 0, 2, timeout_s=30, epoch=2, secret=bytes(32)))
for version, channel in ((1, old), (2, None)):
    if channel is None:  # the version boundary: switch to the group formed meanwhile
        channel = new.wait(40)
        old.close()
    channel.send_tensors(version, [("w", torch.full((300,), float(version))), ("i", torch.arange(5) + version)], 512)
channel.close()
"""


def test_a_weight_group_forms_in_the_background_while_the_old_one_carries_a_version(tmp_path):
    """Two real processes over gloo, as trainer and generator worker: both stay in group 1 while
    group 2 forms on `GroupBuild`'s thread; version 1 goes through group 1, version 2 through group
    2 after the switch, each received whole (compared with the tensors the sender built). A build
    whose peer never comes fails within its timeout naming its epoch, and an abandoned one can no
    longer be handed out."""
    import torch

    from pipeline.weights.group import TorchDistChannel, WeightSyncError
    from pipeline.weights.group_build import GroupBuild

    old_port, new_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    sender = subprocess.Popen([sys.executable, "-c", GROUP_SWITCH_SENDER, str(old_port), str(new_port)],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        old = TorchDistChannel("127.0.0.1", old_port, 1, 2, timeout_s=30, epoch=1, secret=bytes(32))
        new = GroupBuild(2, None, lambda: TorchDistChannel("127.0.0.1", new_port, 1, 2, timeout_s=30, epoch=2, secret=bytes(32)))
        got = {}
        for version in (1, 2):
            channel = old if version == 1 else new.wait(40)
            update = channel.receive()
            got[update.version] = {n: t.clone() for n, t in update}
        for version in (1, 2):
            assert torch.equal(got[version]["w"], torch.full((300,), float(version))), version
            assert torch.equal(got[version]["i"], torch.arange(5) + version), version
        channel.close()
        old.close()
        assert sender.wait(timeout=60) == 0
    finally:
        sender.kill()
    lonely = GroupBuild(3, None, lambda: TorchDistChannel("127.0.0.1", free_port("127.0.0.1"), 1, 2, timeout_s=2, epoch=3, secret=bytes(32)))
    with pytest.raises(WeightSyncError, match="epoch 3 failed to form"):
        lonely.wait(30)
    given_up = GroupBuild(4, None, lambda: TorchDistChannel("127.0.0.1", free_port("127.0.0.1"), 1, 2, timeout_s=2, epoch=4, secret=bytes(32)))
    given_up.abandon()
    with pytest.raises(WeightSyncError, match="abandoned"):
        given_up.wait(30)
