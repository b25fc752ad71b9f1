"""The launch layer on the real single-machine Slurm cluster (slurm/cluster/start.sh): one heterogeneous
job per run, rendezvous between components, MPI under PMIx, forced requeue, and refused requests."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.launch import ComponentSpec, JobPlan, LaunchError, SlurmLauncher, TaskFailed

pytestmark = pytest.mark.slurm
PROBE = "pipeline.launch.probe:probe"
REPO = Path(__file__).resolve().parents[1]


def plan_of(components, **probe) -> JobPlan:
    return JobPlan(name="tf-test", components={
        role: ComponentSpec(entry=PROBE, mem_gb=0.5, time_min=5, **resources) for role, resources in components.items()},
        config={"probe": {"timeout_s": 60, **probe}}, signal_delay_s=30, stop_grace_s=20)


def wait_until(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not true after {timeout_s} s")
        time.sleep(0.2)


def test_cluster_answers_and_sacct_records_jobs():
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30).stdout.split("\n")
    assert len([n for n in nodes if n.strip()]) >= 3, nodes
    job_id = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "exit 3"],
                            capture_output=True, text=True, timeout=30, check=True).stdout.strip()

    def sacct_state():
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out

    wait_until(lambda: sacct_state().startswith("FAILED"), 60, f"sacct reports job {job_id} FAILED")
    assert sacct_state() == "FAILED|3:0"


def test_het_job_runs_every_role_on_its_own_nodes_with_rendezvous(tmp_path):
    run = SlurmLauncher().launch(plan_of({"trainer": dict(nodes=1, tasks_per_node=2),
                                          "generator": dict(nodes=2, tasks_per_node=1)}, rendezvous=True), tmp_path)
    results = run.wait(timeout_s=90)
    assert run.state() == "COMPLETED"
    trainer, generator = results["trainer"], results["generator"]
    assert [r["global_rank"] for r in trainer + generator] == [0, 1, 2, 3]
    assert {r["slurm_job_id"] for r in trainer + generator} == {run.job_id}
    assert {r["het_size"] for r in trainer + generator} == {"2"}
    trainer_nodes, generator_nodes = {r["node"] for r in trainer}, {r["node"] for r in generator}
    assert len(trainer_nodes) == 1 and len(generator_nodes) == 2 and not trainer_nodes & generator_nodes
    published = {role: json.loads((tmp_path / "rendezvous/attempt-0" / f"{role}.json").read_text())
                 for role in ("trainer", "generator")}
    assert published["trainer"]["node"] in trainer_nodes and published["generator"]["node"] in generator_nodes
    assert all(r["peers"] == published for r in trainer + generator)
    for role, rank in run.plan.task_layout():
        assert f"probe {role}.{rank} on " in (tmp_path / "logs" / f"{role}.{rank}.out").read_text()


def test_components_bootstrap_their_process_groups_from_mpi_under_pmix(tmp_path):
    """srun --mpi=pmix: each task's supervisor learns its component rank, size and master address
    from MPI (no file rendezvous), and the trainer's two tasks on two nodes form a gloo group from it."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not importable: install the 'mpi' extra (mpi4py==4.1.*, needs Debian's libopenmpi-dev)")
    plan = plan_of({"trainer": dict(nodes=2), "generator": dict(nodes=1)}, mpi=True)
    plan.mpi = "pmix"
    plan.env = {"OMPI_MCA_btl": "self,tcp"}
    results = SlurmLauncher().launch(plan, tmp_path).wait(timeout_s=120)
    trainer, generator = results["trainer"], results["generator"]
    assert [r["mpi"]["rank"] for r in trainer] == [0, 1] and {r["mpi"]["size"] for r in trainer} == {2}
    assert {r["mpi"]["host"] for r in trainer} == {trainer[0]["node"]} != {trainer[1]["node"]}
    assert [r["allreduce"] for r in trainer] == [3, 3]  # 1 + 2: the group formed across the two nodes
    assert generator[0]["mpi"]["rank"] == 0 and generator[0]["mpi"]["size"] == 1 and generator[0]["allreduce"] == 1
    assert not (tmp_path / "rendezvous").exists() or not any((tmp_path / "rendezvous").rglob("*.json"))
    for role, rank in plan.task_layout():
        assert f"MPI bootstrap: {role} rank {rank} of" in (tmp_path / "logs" / f"{role}.{rank}.out").read_text()


def test_a_job_that_lingers_after_its_tasks_finished_is_cancelled_and_its_results_returned(
        tmp_path, monkeypatch, caplog):
    """Slurm 22.05's `srun` of a het step under PMIx sometimes never returns after every task has
    exited (CI, stops 42 and 44): the job held its nodes RUNNING until a timeout, and that srun
    ignored the cancel's SIGTERM and outlived the job (proctrack/linuxproc lost it when its job
    script died first). Here the job script's EXIT trap holds the job the same way after srun
    returned, in a process that ignores SIGTERM: `wait` cancels the job `linger_s` after the last
    final result instead of waiting out its timeout, and the holder ends with the job (the autouse
    `no_process_left_behind` checks it too). Without the job script's `OUTLIVE_SRUN` trap the holder
    was left running."""
    import pipeline.launch.slurm as slurm

    holder = f"{sys.executable} -c 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'"

    def lingering(plan):
        params = executor_parameters(plan)
        params["setup"] = [*params["setup"], f"trap {shlex.quote(holder)} EXIT"]
        return params

    executor_parameters = slurm.executor_parameters
    monkeypatch.setattr(slurm, "executor_parameters", lingering)
    run = SlurmLauncher().launch(plan_of({"trainer": dict(nodes=1), "generator": dict(nodes=1)}), tmp_path)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="pipeline.launch.base"):
        results = run.wait(timeout_s=150, linger_s=10)
    assert time.monotonic() - start < 120  # not the 600 s the trap holds the job
    assert results["trainer"][0]["role"] == "trainer" and results["generator"][0]["role"] == "generator"
    assert run.lingered and "has its final result, but the run is still RUNNING" in caplog.text
    wait_until(lambda: run.state().startswith("CANCELLED"), 60, "the lingering job cancelled")

    def holders() -> list[str]:
        ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, timeout=30).stdout
        return [line for line in ps.splitlines() if "time.sleep(600)" in line and "SIG_IGN" in line]

    wait_until(lambda: not holders(), 30, "the SIGTERM-ignoring holder of the cancelled job ended")


def test_forced_requeue_runs_every_role_again_as_next_attempt(tmp_path):
    # attempt 0 holds (as a long training would) until requeued; attempt 1 completes.
    run = SlurmLauncher().launch(plan_of({"trainer": dict(nodes=1), "generator": dict(nodes=1)}, hold_s=150), tmp_path)
    wait_until(lambda: len(list((tmp_path / "probe").glob("*.attempt-0.json"))) == 2, 60, "both roles on attempt 0")
    run.requeue()
    results = run.wait(timeout_s=120)
    for role in ("trainer", "generator"):
        assert results[role][0]["attempt"] == 1 and results[role][0]["resumed"] is True
        log = (tmp_path / "logs" / f"{role}.0.out").read_text()
        assert f"=== {role}.0 attempt 0" in log and f"=== {role}.0 attempt 1" in log
    assert run.state() == "COMPLETED"


def test_checkpoint_signal_stops_roles_and_requeues_through_submitit(tmp_path):
    run = SlurmLauncher().launch(plan_of({"trainer": dict(nodes=1), "generator": dict(nodes=1)}, hold_s=150), tmp_path)
    wait_until(lambda: len(list((tmp_path / "probe").glob("*.attempt-0.json"))) == 2, 60, "both roles on attempt 0")
    time.sleep(1)  # both tasks are inside their hold
    run.preempt()
    results = run.wait(timeout_s=120)
    assert results["trainer"][0]["attempt"] == 1 and results["generator"][0]["attempt"] == 1
    # rank 0 (trainer) checkpointed through RoleDispatcher.checkpoint() and requeued; the generator saw the stop
    assert "Calling checkpoint method" in (tmp_path / "logs/trainer.0.out").read_text()
    assert json.loads((tmp_path / "probe/generator.0.attempt-0.json").read_text())["stop_requested"] is True


def test_a_failing_role_ends_the_job_instead_of_hanging(tmp_path):
    # the trainer would wait 300 s for the generator's rendezvous; --kill-on-bad-exit ends the step at once,
    # and the error names the generator (the cause), not the trainer (killed with the step).
    plan = plan_of({"trainer": dict(nodes=1), "generator": dict(nodes=1)}, rendezvous=True, fail_role="generator")
    plan.config["probe"]["timeout_s"] = 300
    run = SlurmLauncher().launch(plan, tmp_path)
    with pytest.raises(TaskFailed, match="task generator.0 failed: RuntimeError: probe: role generator was told to fail"):
        run.wait(timeout_s=90)
    assert run.state().startswith(("FAILED", "CANCELLED"))


def test_impossible_requests_are_refused_before_submission(tmp_path):
    cases = [({"partition": "nosuchpartition"}, "trainer: partition 'nosuchpartition' does not exist (partitions: debug"),
             ({"cpus_per_task": 64}, "trainer: 64 CPUs per node (1 tasks x 64 cpus) but the largest node of 'debug' has"),
             ({"gpus_per_node": 5}, "trainer: 5 GPUs per node but the largest node of 'debug' has 4 GPUs"),
             ({"mem_gb": 1000.0}, "trainer: 1000 GB memory per node"),
             ({"nodes": 3}, "the components need 4 distinct nodes (trainer=3, generator=1)")]
    for override, needle in cases:
        with pytest.raises(LaunchError) as err:
            plan = plan_of({"trainer": dict(nodes=1), "generator": dict(nodes=1)})
            for key, value in override.items():
                setattr(plan.components["trainer"], key, value)
            SlurmLauncher().launch(plan, tmp_path / "refused")
        assert needle in str(err.value), str(err.value)
    assert not (tmp_path / "refused" / "submitit").exists()


def test_sbatch_refusal_surfaces_its_message(tmp_path):
    # the bad request is on the first component: with a bad later one slurmctld creates the earlier
    # components and cancels them, and its backfill may start one in between, whose allocation then
    # stays on its node with no job (seen once: node1 "mixed", every later Slurm test waiting for it)
    plan = plan_of({"trainer": dict(nodes=1, extra_sbatch=["--constraint=nosuchfeature"]), "generator": dict(nodes=1)})
    with pytest.raises(LaunchError, match="sbatch refused the job: .*Invalid feature specification"):
        SlurmLauncher().launch(plan, tmp_path)



def test_single_component_plan_is_a_plain_job_over_two_nodes(tmp_path):
    run = SlurmLauncher().launch(plan_of({"generator": dict(nodes=2, tasks_per_node=2)}), tmp_path)
    reports = run.wait(timeout_s=90)["generator"]
    assert [r["rank"] for r in reports] == [0, 1, 2, 3] and {r["het_size"] for r in reports} == {None}
    assert len({r["node"] for r in reports}) == 2


@pytest.mark.parametrize("distribution", ["block", "cyclic"])
def test_tasks_sharing_a_node_get_disjoint_gpus_as_slurm_bound_them(tmp_path, distribution):
    """2 nodes x 2 tasks with 4 fake GPUs per node (gres/gpu on dummy devices, start.sh): each task
    takes its half of what Slurm bound, by its node-local id; under cyclic distribution ranks 0 and
    2 share a node (the old block assumption gave both GPUs 0,1)."""
    plan = plan_of({"generator": dict(nodes=2, tasks_per_node=2, gpus_per_node=4,
                                      extra_sbatch=[f"--distribution={distribution}"])})
    reports = SlurmLauncher().launch(plan, tmp_path).wait(timeout_s=120)["generator"]
    by_node: dict = {}
    for r in reports:
        by_node.setdefault(r["node"], []).append(r["gpus"])
    assert len(by_node) == 2 and all(sorted(g) == ["0,1", "2,3"] for g in by_node.values()), reports
    same_node = (reports[0]["node"] == reports[2]["node"]) if distribution == "cyclic" else \
        (reports[0]["node"] == reports[1]["node"])
    assert same_node, [(r["rank"], r["node"]) for r in reports]


def test_doctor_shows_disjoint_gpu_placement_on_the_cluster(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "doctor", "cluster=slurm",
                          "cluster.generator.gpus_per_node=4", "cluster.generator.tasks_per_node=2",
                          "cluster.generator.nodes=1", "cluster.generators=2", "generator.tensor_parallel_size=2",
                          "cluster.trainer.mem_gb=1", "cluster.generator.mem_gb=1", "cluster.trainer.cpus_per_task=1",
                          "cluster.generator.cpus_per_task=1"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert "[placement] generator: 1 node(s) x 2 task(s), 4 GPU(s) per node; on each node, of the GPUs Slurm " \
           "binds (by SLURM_LOCALID, block or cyclic): local task 0: GPUs 0,1; local task 1: GPUs 2,3" in out.stdout, \
        out.stdout + out.stderr
    assert "refused: [placement]" not in out.stdout, out.stdout  # the nodes have the GPUs (sinfo)

