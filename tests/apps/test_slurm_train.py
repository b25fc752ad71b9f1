"""`tokenflow train cluster=slurm` on the real single-machine cluster (slurm/cluster/start.sh).

A tiny run (1 trainer task + 1 vLLM generator task, ONE heterogeneous job over two fake nodes) is
forced through two requeues — `scontrol requeue` (hard: the trainer relies on its last checkpoint)
and the checkpoint signal (graceful: the trainer checkpoints where it stopped) — and must finish
with every admitted group stored exactly once, the staleness bound kept and nothing trained lost.
Also: a 2-point sweep submits one heterogeneous job per point, `tokenflow status`/`cancel`, the
hand-written slurm/train.sbatch, and refused or failing launches.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.rollout_log.format import GroupOutcome
from pipeline.rollout_log.reader import RolloutLog
from pipeline.metrics import read_metrics
from support.child_env import child_env
from support.slurm_runs import (REPO, TINY, ended, preempt_trainer_node, status_of, submit_probe_batch,
                                submitted_job, tokenflow, wait_until)

pytestmark = [pytest.mark.slurm, pytest.mark.engine]

def steps_logged(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run, "train_step")]


@pytest.mark.slow  # about 6 min on 2 cores (334 s measured): three attempts, each starts its engine
def test_tiny_run_survives_two_requeues_with_exactly_once_storage(tmp_path):
    run = tmp_path / "rq"
    steps = 16  # enough that the run is still going when the requeues come, however fast the machine
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", "run.name=rq", f"hydra.run.dir={run}",
                             f"run.steps={steps}", "run.checkpoint_every=2", *TINY], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=REPO)
    try:
        job_id = wait_until(lambda: submitted_job(run), 60, "the job was submitted")
        # 1) hard requeue once a checkpoint is complete: the tasks are killed, the trainer resumes from it
        from pipeline.trainer.checkpoint_writer import complete_checkpoints
        wait_until(lambda: complete_checkpoints(run), 240, "a complete checkpoint")
        s = status_of(run)
        assert [c["state"] for c in s["components"]] == ["RUNNING", "RUNNING"], s
        nodes = [c["nodes"] for c in s["components"]]
        assert len(set(nodes)) == 2, f"trainer and generator must run on distinct fake nodes: {nodes}"
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        t_requeue = time.time()
        # 2) checkpoint signal once attempt 1 trained a step: the trainer checkpoints where it stops
        # (attempt 0 may still finish the step it was in after the requeue's SIGTERM: wait for attempt 1's)
        attempt1 = run / "rendezvous/attempt-1"
        wait_until(lambda: attempt1.exists() and [r for r in read_metrics(run, "train_step")
                                                  if r["t"] > attempt1.stat().st_mtime], 240,
                   "a step trained by attempt 1")
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        out, _ = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", str(job_id)], timeout=30)
    assert proc.returncode == 0, out[-4000:]
    trainer_log = (run / "logs/trainer.0.out").read_text()
    assert [int(a) for a in re.findall(r"=== trainer\.0 attempt (\d+)", trainer_log)] == [0, 1, 2]
    assert "SIGUSR2 received" in trainer_log
    orchestrator_log = (run / "logs/orchestrator.out").read_text()
    resumes = [int(k) for k in re.findall(r"trainer resumes at step (\d+)", orchestrator_log)]
    assert resumes[0] == 0 and resumes[1] >= 2 and len(resumes) == 3, resumes
    # graceful stop: attempt 2 resumed exactly after the last step attempt 1 trained (nothing trained lost)
    records = list(read_metrics(run, "train_step"))
    t_attempt2 = min(p.stat().st_mtime for p in (run / "rendezvous/attempt-2").iterdir())
    attempt1 = [r["step"] for r in records if t_requeue < r["t"] < t_attempt2]
    assert attempt1 and resumes[2] == 1 + max(attempt1), (resumes, attempt1)
    assert re.search(rf"resumed from \S+/checkpoints/step-{resumes[2]}\n", trainer_log), trainer_log[-3000:]
    assert sorted(set(r["step"] for r in records)) == list(range(steps))
    assert max(r["staleness_max"] for r in records) <= 1
    with RolloutLog.open(run) as log:
        g = log.groups()
        stored = g["group_id"][g["outcome"] == GroupOutcome.STORED]
        assert len(stored) == len(np.unique(stored)), "a group was stored twice"
        state = log.resume_state()
        assert state.duplicate_groups == 0 and not state.problems, state.problems
        assert state.last_step == steps - 1
        min_versions = log.min_versions()
        for step, version, rows in log.step_records():  # the staleness bound held for every batch
            assert (version - min_versions[rows] <= 1).all(), (step, version)
        assert len(np.unique(min_versions)) >= 2
    # one orchestrator (one log writer) start per attempt: none was restarted inside an attempt
    from support.chaos import orchestrator_starts
    assert len(orchestrator_starts(run)) == 3, orchestrator_log[-3000:]
    assert (run / "COMPLETE").exists() and (run / "training.png").exists()
    final = status_of(run)
    assert final["complete"] and final["steps_done"] == steps and final["attempt"] == 2
    assert [c["state"] for c in final["components"]] == ["COMPLETED", "COMPLETED"]


def test_sweep_submits_one_het_job_per_point_then_status_and_cancel(tmp_path):
    out = tokenflow("train", "-m", "trainer.lr=1e-4,2e-4", "run.name=sw", f"hydra.sweep.dir={tmp_path}/sw",
                    "run.detach=true", "run.steps=2", *TINY, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    runs = sorted(p for p in (tmp_path / "sw").iterdir() if (p / "launch/launches.jsonl").exists())
    assert [p.name for p in runs] == ["0", "1"]
    jobs = [json.loads((p / "launch/launches.jsonl").read_text())["job_id"] for p in runs]
    assert len(set(jobs)) == 2 and all(jobs)
    assert [json.loads((p / "launch/plan.json").read_text())["components"].keys() for p in runs] == \
        [{"trainer": 0, "generator": 0}.keys()] * 2
    assert "tokenflow status" in out.stdout
    for p, lr in zip(runs, ("0.0001", "0.0002")):
        assert f"lr: {lr}" in (p / "config.yaml").read_text()
    try:
        states = [[c["state"] for c in status_of(p)["components"]] for p in runs]
        for s in states:  # 3 nodes fit one run (2 nodes) at a time: the other one waits
            assert len(s) == 2 and set(s) <= {"PENDING", "RUNNING", "CONFIGURING"}, states
        text = tokenflow("status", str(runs[0])).stdout
        assert f"slurm job {jobs[0]}" in text and "trainer" in text and "generator" in text
        again = tokenflow("train", "run.name=sw", f"hydra.run.dir={runs[0]}", "run.steps=2", "trainer.lr=1e-4", *TINY)
        assert again.returncode == 2 and f"still running as Slurm job {jobs[0]}" in again.stderr, again.stderr
    finally:
        for p in runs:
            cancelled = tokenflow("cancel", str(p))
            assert cancelled.returncode == 0 and "scancel" in cancelled.stdout, cancelled.stderr
    for p in runs:
        wait_until(lambda: all(c["state"].startswith("CANCELLED") for c in status_of(p)["components"]), 60,
                   f"{p} cancelled", poll_s=2)


def test_sbatch_template_runs_a_plan_as_one_het_job_and_requeues_itself(tmp_path):
    # the probe holds on attempt 0 until the checkpoint signal; the batch script then requeues the job
    job_id = submit_probe_batch(tmp_path, "tf-sbatch", hold_s=150)
    try:
        wait_until(lambda: len(list((tmp_path / "probe").glob("*.attempt-0.json"))) == 2, 60, "both roles started")
        time.sleep(1)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        wait_until(lambda: len(list((tmp_path / "probe").glob("*.attempt-1.json"))) == 2, 120, "the requeued start")
        wait_until(lambda: all(c["state"].startswith(("COMPLETED", "FAILED", "CANCELLED"))
                               for c in status_of(tmp_path)["components"]), 60, "the batch job ended", poll_s=2)
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
    s = status_of(tmp_path)
    batch_log = (tmp_path / "batch.out").read_text()
    assert s["launcher"] == "sbatch" and s["job_id"] == job_id and s["attempt"] == 1
    assert [c["state"] for c in s["components"]] == ["COMPLETED", "COMPLETED"], batch_log
    assert f"requeueing job {job_id}" in batch_log and "restart 1" in batch_log
    reports = {role: json.loads((tmp_path / f"results/{role}.0.json").read_text())["result"]
               for role in ("trainer", "generator")}
    assert reports["trainer"]["het_size"] == "2" and reports["trainer"]["node"] != reports["generator"]["node"]
    assert reports["generator"]["peers"]["trainer"]["node"] == reports["trainer"]["node"]
    assert {r["attempt"] for r in reports.values()} == {1}


def test_impossible_requests_are_refused_before_submission(tmp_path):
    for override, needle in (("cluster.trainer.partition=nosuch", "trainer: partition 'nosuch' does not exist"),
                             ("cluster.generator.cpus_per_task=64", "generator: 64 CPUs per node"),
                             ("cluster.generator.nodes=3", "need 4 distinct nodes")):
        extra = ["cluster.generators=3"] if override.endswith("nodes=3") else []
        out = tokenflow("train", "run.name=bad", f"hydra.run.dir={tmp_path}/bad", *TINY, override, *extra)
        refused = "cannot start the run" in out.stderr or "cannot launch the run" in out.stderr  # doctor, or sbatch
        assert out.returncode == 2 and refused and needle in out.stderr, out.stderr
        assert not (tmp_path / "bad/submitit").exists()


def test_a_missing_model_is_refused_before_anything_is_submitted(tmp_path):
    out = tokenflow("train", "run.name=broken", f"hydra.run.dir={tmp_path}/broken", *TINY,
                    "model.name=/nonexistent/checkpoint", timeout=240)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "cannot start the run" in out.stderr and "/nonexistent/checkpoint" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "broken" / "launch" / "launches.jsonl").exists()  # nothing was submitted


@pytest.mark.slow  # about 12 min on 2 cores (708 s measured on a loaded machine): TOKENFLOW_SLOW=1 runs it
def test_kill_9_of_orchestrator_generator_and_engine_then_preemption(tmp_path):
    """On the cluster: kill -9 of the orchestrator, of the generator's engine and of its restarted
    role process, at seeded steps (seed printed), all recovered inside the job (no requeue, no
    trainer restart); then a higher-priority job preempts it (partition `urgent` over
    `preemptible`): SIGTERM, the trainer checkpoints at its step boundary, Slurm requeues the job
    (no task requeues it), and the requeued job resumes exactly after the last step trained.

    Every strike waits for a step in the metrics, never for wall time. The preemption is submitted
    once a step was trained after the second generator kill (the third of the seeded kills lands after
    step 3), with about 43 of the 48 steps left: at ~0.5 s a step that is ~20 s of training, against ~1 s for the scheduler to preempt (sched_min_interval
    0.1 s); a run that finishes first fails with that said."""
    from support.chaos import Chaos, check_record, engine_process, loaded_after_restart, orchestrator_process, role_process, wait_for
    from support.chaos import last_step as chaos_last_step

    run = tmp_path / "chaos"
    steps = 48
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", "run.name=chaos", f"hydra.run.dir={run}",
                             f"run.steps={steps}", "run.checkpoint_every=50", "orchestrator.generator_dead_after_s=5",
                             "generator.weight_timeout_s=30", *TINY, "cluster.trainer.partition=preemptible",
                             "cluster.generator.partition=preemptible"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=REPO)
    chaos = Chaos(run, ["orchestrator", "engine", "generator"], first=1, spread=1,
                  running=lambda: proc.poll() is None)
    orch, engine, gen = chaos.kills
    with ended(proc, run) as urgent:
        wait_until(lambda: submitted_job(run), 60, "the job was submitted")
        trainer_pid = wait_for(lambda: role_process(run, 0), 240, "the trainer role process")
        first_gen = wait_for(lambda: role_process(run, 1), 240, "the generator role process")
        chaos.strike(orch, lambda: orchestrator_process(run))
        chaos.strike(engine, lambda: engine_process(run, 1))
        restarted = lambda: role_process(run, 1) not in (None, first_gen) and role_process(run, 1)
        wait_for(lambda: loaded_after_restart(run, "generator", 0, 1), 400, "the restarted generator to load weights")
        chaos.strike(gen, restarted)
        wait_for(lambda: loaded_after_restart(run, "generator", 0, 2), 400, "the generator's second restart")
        wait_for(lambda: [r for r in read_metrics(run, "train_step") if r["t"] > gen.t], 400,
                 "training after the second generator kill")
        assert role_process(run, 0) == trainer_pid, "the trainer restarted"
        urgent.append(preempt_trainer_node(run))
        preempted_at = chaos_last_step(run)
        wait_for(lambda: "SIGTERM received" in (run / "logs/trainer.0.out").read_text(), 120,
                 f"the preemption's SIGTERM (urgent job {urgent[0]} submitted after step {preempted_at} of {steps})",
                 chaos.running)
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    trainer_log = (run / "logs/trainer.0.out").read_text()
    assert [int(a) for a in re.findall(r"=== trainer\.0 attempt (\d+)", trainer_log)] == [0, 1], trainer_log[-3000:]
    assert "SIGTERM received" in trainer_log and "SIGUSR2" not in trainer_log
    assert "restart 2 of 3" in (run / "logs/generator.0.out").read_text()
    t_attempt1 = min(p.stat().st_mtime for p in (run / "rendezvous/attempt-1").iterdir())
    before = [r["step"] for r in read_metrics(run, "train_step") if r["t"] < t_attempt1]
    resumes = [int(k) for k in re.findall(r"trainer resumes at step (\d+)", (run / "logs/orchestrator.out").read_text())]
    assert resumes[-1] == 1 + max(before), (resumes, before)  # exact: checkpointed where it stopped
    check_record(run, steps, max_staleness=1)
    print("recovery " + json.dumps({"seed": chaos.seed, "recoveries": [chaos.recovery(k) for k in chaos.kills]}))


@pytest.mark.slow  # about 5 min on 2 cores: TOKENFLOW_SLOW=1 runs it
def test_kill_9_of_trainer_rank_0_ends_the_job_and_the_same_command_resumes(tmp_path):
    """kill -9 of trainer rank 0's role process at a seeded step: the job ends (the trainer is not
    restarted in place: its state is the checkpoint's), `tokenflow train` exits non-zero naming
    trainer.0, nothing is left running, and the same command resumes the run to the end with every
    group stored once and the staleness bound kept."""
    import random
    import signal

    from support.chaos import check_record, last_step, role_process, wait_for

    seed = int(os.environ.get("TOKENFLOW_CHAOS_SEED", random.randrange(1 << 20)))
    steps = 8
    kill_after = random.Random(seed).randrange(2, 5)
    print(f"seed {seed} (TOKENFLOW_CHAOS_SEED): kill -9 trainer rank 0 after step {kill_after}")
    run = tmp_path / "tk"
    args = ["train", "run.name=tk", f"hydra.run.dir={run}", f"run.steps={steps}", "run.checkpoint_every=2", *TINY]
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=REPO)
    with ended(proc, run):
        wait_for(lambda: last_step(run) >= kill_after, 400, f"step {kill_after}", lambda: proc.poll() is None)
        os.kill(role_process(run, 0), signal.SIGKILL)
        t_kill = time.monotonic()
        out, _ = proc.communicate(timeout=300)
        print(f"tokenflow train returned {proc.returncode} {time.monotonic() - t_kill:.1f} s after the kill")
    assert proc.returncode != 0 and "trainer.0" in out, out[-3000:]
    assert status_of(run)["components"][0]["state"] in ("FAILED", "CANCELLED"), status_of(run)
    again = tokenflow(*args, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    check_record(run, steps, max_staleness=1)
