"""The launch layer without Slurm: plans, role layout, rendezvous files, and LocalLauncher running the probe role."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from pipeline.launch import (ComponentSpec, JobPlan, LaunchError, LocalLauncher, Rendezvous, RendezvousTimeout,
                             TaskFailed)
from pipeline.launch.slurm import executor_parameters, fold_states
from pipeline.launch.slurm_checks import SlurmNode, SlurmPartition, check_plan, parse_time_min
from pipeline.launch.supervisor import ROLE_PROCESS_ENV
from pipeline.launch.task import locate, result_path

PROBE = "pipeline.launch.probe:probe"


def toy_plan(**probe) -> JobPlan:
    return JobPlan(name="toy", components={
        "trainer": ComponentSpec(entry=PROBE, nodes=1, tasks_per_node=2),
        "generator": ComponentSpec(entry=PROBE, nodes=2, tasks_per_node=1)},
        config={"probe": {"timeout_s": 60, **probe}})


def test_layout_numbers_tasks_component_after_component():
    plan = toy_plan()
    assert plan.task_layout() == [("trainer", 0), ("trainer", 1), ("generator", 0), ("generator", 1)]
    env = {"SLURM_PROCID": "3", "SLURM_HET_SIZE": "2", "SLURM_NTASKS_HET_GROUP_0": "2", "SLURM_NTASKS_HET_GROUP_1": "2"}
    assert locate(plan, env) == (3, "generator", 1)
    with pytest.raises(LaunchError, match="het component 1 \\(generator\\) has 3 tasks"):
        locate(plan, {**env, "SLURM_NTASKS_HET_GROUP_1": "3"})
    with pytest.raises(LaunchError, match="2 \\(trainer, generator\\)"):
        locate(plan, {"SLURM_PROCID": "0"})


def test_plan_validation_names_each_problem():
    plan = JobPlan(components={"Trainer": ComponentSpec(entry="nope", nodes=0, mem_gb=0)})
    with pytest.raises(LaunchError) as err:
        plan.validate()
    text = str(err.value)
    for needle in ("'Trainer' is not a role name", "entry 'nope'", "nodes=0", "mem_gb=0"):
        assert needle in text
    with pytest.raises(LaunchError, match="no components"):
        JobPlan().validate()


def test_an_sbatch_option_or_env_name_cannot_inject_shell_into_the_job_script():
    plan = toy_plan()
    plan.components["generator"].extra_sbatch = ["--constraint=fast\ntouch /tmp/pwned"]
    plan.env = {"A; touch /tmp/pwned; B": "1"}
    with pytest.raises(LaunchError) as err:
        plan.validate()
    assert "without control characters" in str(err.value) and "is not a variable name" in str(err.value)
    plan.components["generator"].extra_sbatch = ["--constraint=fast", "-C gpu", "--exclusive"]
    plan.env = {"OMP_NUM_THREADS": "1"}
    plan.validate()


def test_plan_json_round_trip():
    plan = toy_plan(rendezvous=True)
    plan.components["generator"].extra_sbatch = ["--constraint=fast"]
    assert JobPlan.from_json(plan.to_json()) == plan


def test_sbatch_directives_for_het_components():
    plan = toy_plan()
    plan.components["generator"].partition = "gen"
    plan.components["generator"].gpus_per_node = 2
    params = executor_parameters(plan)
    assert params["nodes"] == 1 and params["ntasks_per_node"] == 2
    setup = params["setup"]
    assert setup[0] == "#SBATCH hetjob"
    assert "#SBATCH --nodes=2" in setup and "#SBATCH --partition=gen" in setup and "#SBATCH --gpus-per-node=2" in setup
    assert "--het-group=0,1" in params["srun_args"]


def test_fold_states_of_het_components():
    assert fold_states(["COMPLETED", "RUNNING"]) == "RUNNING"
    assert fold_states(["COMPLETED", "FAILED"]) == "FAILED"
    assert fold_states(["CANCELLED by 0", "COMPLETED"]) == "CANCELLED by 0"
    assert fold_states(["COMPLETED", "COMPLETED"]) == "COMPLETED"


def test_cluster_checks_name_the_cause():
    parts = {"debug": SlurmPartition("debug", True, True, max_time_min=90, max_nodes=None)}
    nodes = [SlurmNode(f"n{i}", cpus=4, mem_mb=4000, gpus=0, state="IDLE", partitions=["debug"]) for i in range(3)]
    check_plan(toy_plan(), parts, nodes)  # fits: 1 + 2 distinct nodes
    cases = [("partition", "gpu", "partition 'gpu' does not exist (partitions: debug)"),
             ("cpus_per_task", 3, "6 CPUs per node (2 tasks x 3 cpus) but the largest node of 'debug' has 4 CPUs"),
             ("gpus_per_node", 1, "1 GPUs per node"),
             ("mem_gb", 8.0, "8 GB memory per node"),
             ("time_min", 120, "time_min=120 exceeds 'debug' MaxTime of 90 min"),
             ("nodes", 3, "need 5 distinct nodes")]
    for field, value, needle in cases:
        plan = toy_plan()
        setattr(plan.components["trainer"], field, value)
        with pytest.raises(LaunchError) as err:
            check_plan(plan, parts, nodes)
        assert needle in str(err.value), (field, str(err.value))
    assert parse_time_min("1-02:03:00") == 26 * 60 + 3 and parse_time_min("UNLIMITED") is None


def test_rendezvous_publish_wait_and_timeout(tmp_path):
    rv = Rendezvous(tmp_path, attempt=0)
    threading.Timer(0.2, rv.publish, args=("orchestrator", {"port": 1234})).start()
    assert rv.wait("orchestrator", timeout_s=10) == {"port": 1234}
    assert Rendezvous(tmp_path, attempt=1).get("orchestrator") is None  # attempts never see each other
    with pytest.raises(RendezvousTimeout, match="'generator' not published .* \\(present: \\['orchestrator'\\]"):
        rv.wait("generator", timeout_s=0.2)
    with pytest.raises(ValueError):
        rv.publish("../escape", {})


def test_local_launcher_runs_every_role_with_rendezvous(tmp_path):
    run = LocalLauncher().launch(toy_plan(rendezvous=True), tmp_path / "run")
    results = run.wait(timeout_s=120)
    assert run.state() == "COMPLETED"
    assert [r["rank"] for r in results["trainer"]] == [0, 1] and [r["rank"] for r in results["generator"]] == [0, 1]
    assert {r["global_rank"] for rs in results.values() for r in rs} == {0, 1, 2, 3}
    published = {role: json.loads((tmp_path / "run/rendezvous/attempt-0" / f"{role}.json").read_text())
                 for role in ("trainer", "generator")}
    for reports in results.values():
        for report in reports:
            assert report["peers"] == published and report["attempt"] == 0
    for role, rank in run.plan.task_layout():
        assert f"probe {role}.{rank}" in (tmp_path / "run/logs" / f"{role}.{rank}.out").read_text()
    # the same command again on the same run directory is attempt 1
    again = LocalLauncher().launch(toy_plan(), tmp_path / "run").wait(timeout_s=120)
    assert {r["attempt"] for rs in again.values() for r in rs} == {1}
    assert all(r["resumed"] for rs in again.values() for r in rs)


def test_local_launcher_stops_the_run_when_a_role_fails(tmp_path):
    # generators fail; the trainer would otherwise wait 300 s for their rendezvous: the run must stop it,
    # and the error must name the failed role, not its victim (either generator task: both fail, and the
    # first to end is named).
    plan = toy_plan(rendezvous=True, fail_role="generator")
    plan.config["probe"]["timeout_s"] = 300
    plan.components["trainer"].tasks_per_node = 1
    run = LocalLauncher(kill_grace_s=5).launch(plan, tmp_path / "run")
    with pytest.raises(TaskFailed, match=r"task generator\.[01] failed: RuntimeError: probe: role generator was told to fail"):
        run.wait(timeout_s=120)
    assert run.state() == "FAILED" and run.done()


ENGINE_OWNER_ROLE = """
import os, sys
from pathlib import Path
from pipeline.launch import ComponentSpec, JobPlan
from pipeline.launch.task import run_task

def role(task):
    from pipeline.generator.owner_watch import RPC_DIR_ENV, mark_owner
    mark_owner()  # what a role does right before it builds a vLLM engine
    print("socket directory", os.environ[RPC_DIR_ENV], flush=True)
    raise RuntimeError("the role fails")

run_task(JobPlan(name="t", components={"generator": ComponentSpec(entry="__main__:role")}), Path(sys.argv[1]), 0,
         os.environ)
"""


def test_a_role_that_fails_leaves_no_engine_socket_directory(tmp_path):
    """A failed role process leaves through ``os._exit`` (no atexit): the private directory of its
    engine's sockets (`pipeline.generator.owner_watch.mark_owner`) is removed on the way."""
    script = tmp_path / "role.py"
    script.write_text(ENGINE_OWNER_ROLE)
    result_path(tmp_path / "run", "generator", 0).parent.mkdir(parents=True)  # as its supervisor makes it
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=60, env={**os.environ, ROLE_PROCESS_ENV: "0", "TOKENFLOW_GLOBAL_RANK": "0"})
    assert out.returncode == 1 and "the role fails" in out.stderr, out.stdout + out.stderr
    made = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("socket directory")]
    assert made and "tf-engine-" in made[0], out.stdout
    assert not os.path.exists(made[0]), f"the failed role left its engine's socket directory {made[0]}"


def test_checkpoint_signal_sets_stop_requested_and_children_survive_it(tmp_path):
    # A task blocks USR2 before its role starts children: the signal stops the role (stop_requested)
    # and never kills the children it started (vLLM engine cores, the orchestrator).
    script = tmp_path / "t.py"
    script.write_text(
        "import os, signal, subprocess, sys, threading, time\n"
        "from pipeline.launch.task import StopWatcher\n"
        "event = threading.Event()\n"
        "StopWatcher(event)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "time.sleep(0.5)\n"
        "os.kill(child.pid, signal.SIGUSR2); os.kill(os.getpid(), signal.SIGUSR2)\n"
        "line = f'stopped {event.wait(10)} child alive {child.poll() is None}'\n"
        "print(line, flush=True)  # one write: the watcher's own note may land before or after it\n"
        "child.kill()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert "stopped True child alive True" in out.stdout, out.stdout + out.stderr
    assert "SIGUSR2 received" in out.stdout


def test_status_and_cancel_of_a_local_run(tmp_path):
    """`tokenflow cancel` ends the run's tasks and a generator job that joined it before it returns."""
    from pipeline.apps.ops import cancel_run, run_status
    from pipeline.supervise import process_group

    plan = toy_plan(hold_s=120)
    plan.components["trainer"].tasks_per_node = 1
    run = LocalLauncher(kill_grace_s=5).launch(plan, tmp_path / "run")
    deadline = time.monotonic() + 60
    while len(list((tmp_path / "run/probe").glob("*.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    s = run_status(tmp_path / "run")
    assert s["launcher"] == "local" and [c["state"] for c in s["components"]] == ["RUNNING", "RUNNING"]
    assert [c["tasks"] for c in s["components"]] == [1, 2] and s["attempt"] == 0
    joined = _joined_generator_job(tmp_path / "run")
    assert "SIGTERM" in cancel_run(tmp_path / "run")
    assert not process_group(joined.pids[0]), "cancel returned with the joined generator job running"
    deadline = time.monotonic() + 90  # a loaded 2-core machine may take a while to stop the tasks
    while not run.done() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run.done() and [c["state"] for c in run_status(tmp_path / "run")["components"]] == ["EXITED", "EXITED"]
    joined.cancel()  # reaps it


def _joined_generator_job(run_dir):
    """A probe task recorded as a generator job that joined the run (`tokenflow generators`), running."""
    from pipeline.launch.task import PLAN_ENV
    from pipeline.run_files import GENERATOR_JOB_PLAN, GENERATOR_JOBS_FILE

    plan_file = GENERATOR_JOB_PLAN.format(index=0)
    job = JobPlan(name="job", components={"generator": ComponentSpec(entry=PROBE, tasks_per_node=1, first_rank=2)},
                  config={"probe": {"timeout_s": 60, "hold_s": 120}}, env={PLAN_ENV: plan_file})
    launched = LocalLauncher(kill_grace_s=5).launch(job, run_dir, plan_file=plan_file,
                                                    launches_file=GENERATOR_JOBS_FILE, job="genjob-0",
                                                    first_rank=2, count=1)
    deadline = time.monotonic() + 60
    while not list(run_dir.glob("probe/generator.2.attempt-*.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launched.state() == "RUNNING"
    return launched


def test_cancel_ends_a_local_task_that_does_not_stop(tmp_path):
    from pipeline.apps.ops import cancel_run
    from pipeline.supervise import process_group

    plan = toy_plan(hold_s=300)
    plan.config["probe"]["deaf_role"] = "generator"
    run = LocalLauncher(kill_grace_s=5).launch(plan, tmp_path / "run")
    deadline = time.monotonic() + 60
    while len(list((tmp_path / "run/probe").glob("*.json"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    said = cancel_run(tmp_path / "run", grace_s=5)
    assert "got SIGKILL" in said and "every task stopped" not in said, said
    assert not any(process_group(pid) for pid in run.pids)  # nothing of the run is left when cancel returns
    assert [json.loads(p.read_text())["ok"] for p in sorted((tmp_path / "run/results").glob("trainer.*"))] == [True, True]


def test_batch_prepare_reuses_the_launch_index_of_a_requeued_job(tmp_path):
    from pipeline.apps.batch import _record_launch

    assert _record_launch(tmp_path, "41") == 0
    assert _record_launch(tmp_path, "41") == 0  # the same job, requeued
    assert _record_launch(tmp_path, "57") == 1  # a new job on the same run directory


def test_batch_prepare_composes_the_config_and_plan_like_tokenflow_train(tmp_path):
    from pipeline.apps.batch import prepare

    run_dir, _ = prepare(["cluster=slurm", "run.name=hand", f"hydra.run.dir={tmp_path}/hand", "cluster.generators=3",
                          "cluster.generator.nodes=3", "cluster.generator.partition=gen"])
    assert run_dir == (tmp_path / "hand").resolve() and (run_dir / "config.yaml").exists()
    plan = JobPlan.from_json((run_dir / "launch/plan.json").read_text())
    assert list(plan.components) == ["trainer", "generator"]
    assert plan.components["generator"].nodes == 3 and plan.components["generator"].partition == "gen"
    assert plan.config["run_dir"] == str(run_dir)
    with pytest.raises(SystemExit, match="cluster=slurm"):
        prepare(["run.name=local", f"hydra.run.dir={tmp_path}/local"])
