"""Preemption with a slowed checkpoint on the test cluster (slurm/cluster/start.sh, partition
`preemptible`: PreemptMode REQUEUE, GraceTime 60 s): the run's ``checkpoints/`` is a directory of
the loopback network filesystem reached through a relay that passes a set number of bytes per
second (`support.slow_netfs`, which says why this stand-in). Either the save fits the grace and
the preempted run resumes from it, or `tokenflow train` refuses the configuration before anything
is submitted, naming the numbers.

The tiny-moe checkpoint is 26.8 MB (2.2 M parameters x 12 bytes). At 0.5 MB/s a save takes ~54 s,
~108 s with a save in flight first: more than the 60 s of GraceTime and of cluster.stop_grace_s.
At 4 MB/s it takes ~7 s.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pipeline.metrics import read_metrics
from pipeline.trainer.checkpoint_writer import complete_checkpoints
from support.child_env import child_env
from support.log_places import NETFS_ROOT, netfs_mounts
from support.slow_netfs import throttled_mount
from support.slurm_runs import REPO, TINY, ended, preempt_trainer_node, submitted_job, tokenflow, wait_until

pytestmark = [pytest.mark.slurm]
PREEMPTIBLE = ["cluster.trainer.partition=preemptible", "cluster.generator.partition=preemptible"]


@pytest.fixture
def slow_checkpoints(tmp_path):
    """``make(rate)``: the run directory tmp_path/run whose checkpoints/ writes at ``rate`` bytes/s."""
    _, why = netfs_mounts()
    if why:
        pytest.skip(why)
    mounts = []

    def make(rate: float):
        run = tmp_path / "run"
        run.mkdir(mode=0o700)
        cm = throttled_mount(tmp_path / "slow", rate, NETFS_ROOT)
        mounts.append(cm)
        (run / "checkpoints").symlink_to(cm.__enter__())
        return run

    yield make
    for cm in mounts:
        cm.__exit__(None, None, None)


def test_a_save_the_preemption_grace_cannot_cover_is_refused_before_submission(slow_checkpoints):
    """About 15 s: the doctor's probe (a few seconds on the slow mount) and nothing submitted."""
    run = slow_checkpoints(0.5e6)
    out = tokenflow("train", "run.name=slowck", f"hydra.run.dir={run}", *TINY, *PREEMPTIBLE, timeout=240)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    refusals = [line for line in out.stderr.splitlines() if line.startswith("refused: [checkpoint-grace]")]
    graces = {re.search(r"but (.+) gives (\d+) s", line).groups() for line in refusals}
    assert graces == {("cluster.stop_grace_s (checkpoint signal to requeue)", "60"),
                      ("GraceTime of partition preemptible (preemption, trainer)", "60"),
                      ("GraceTime of partition preemptible (preemption, generator)", "60")}, out.stderr
    needed, size = re.search(r"needs (\d+) s \(([\d.]+) MB", refusals[0]).groups()
    assert float(size) == pytest.approx(26.8, abs=0.1) and int(needed) > 60
    assert submitted_job(run) is None and not (run / "submitit").exists()


@pytest.mark.slow  # about 4 min on 2 cores (248 s measured): two attempts, each starts its engine; TOKENFLOW_SLOW=1 runs it
def test_preempted_run_finishes_its_slowed_save_in_the_grace_and_resumes_from_it(slow_checkpoints):
    """At 4 MB/s (7 s a save, checkpoint_every 4 so a save is often in flight) the doctor accepts
    the run; a higher-priority job preempts it; the trainer completes the save in flight and its
    stop save on the slow filesystem within GraceTime, the requeued job resumes exactly after the
    last step trained, and two checkpoints remain at the end (run.keep_checkpoints=2).

    generator.weight_timeout_s=30 as in the chaos test: a weight broadcast in flight when the
    generators stop holds the trainer (inside gloo, where no signal handler runs) until that
    timeout, 120 s by default, longer than the 60 s of GraceTime (seen here: no save at all)."""
    run = slow_checkpoints(4e6)
    steps = 40
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "train", "run.name=slowck", f"hydra.run.dir={run}",
                             f"run.steps={steps}", "run.checkpoint_every=4", "generator.weight_timeout_s=30",
                             *TINY, *PREEMPTIBLE],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=REPO)
    with ended(proc, run) as urgent:
        wait_until(lambda: submitted_job(run), 120, "the job was submitted")
        wait_until(lambda: len(list(read_metrics(run, "train_step"))) >= 6 or proc.poll() is not None, 400,
                   "six steps trained")
        urgent.append(preempt_trainer_node(run))
        wait_until(lambda: "SIGTERM received" in (run / "logs/trainer.0.out").read_text() or proc.poll() is not None,
                   120, f"the preemption's SIGTERM (urgent job {urgent[0]})")
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    trainer_log = (run / "logs/trainer.0.out").read_text()
    assert [int(a) for a in re.findall(r"=== trainer\.0 attempt (\d+)", trainer_log)] == [0, 1], trainer_log[-3000:]
    t_attempt1 = min(p.stat().st_mtime for p in (run / "rendezvous/attempt-1").iterdir())
    before = [r["step"] for r in read_metrics(run, "train_step") if r["t"] < t_attempt1]
    resumed = int(re.search(r"resumed from \S+/checkpoints/step-(\d+)\n", trainer_log).group(1))
    assert resumed == 1 + max(before), (resumed, before)  # the stop's save completed in the grace
    assert [k for k, _ in complete_checkpoints(run)] == [36, 40]
    assert sorted({r["step"] for r in read_metrics(run, "train_step")}) == list(range(steps))
