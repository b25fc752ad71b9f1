"""The trainer's wait for the first weight group's generators, bounded by their engines' start progress.

A real orchestrator process, a generator process running the real `StartReporter` over ZeroMQ
(its engine a CPU-using stand-in: a real vLLM start takes minutes here), and the leader's real wait
(`WeightPusher.await_generators`). The stalled start is a SIGSTOP of the engine process.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.config import RunConfig, TokenflowConfig, record_schema
from pipeline.generator.config import GeneratorConfig
from pipeline.protocol.links import TrainerLink, read_rendezvous
from pipeline.protocol.messages import StartStatus
from pipeline.roles.cold_start import ColdStartWait
from pipeline.roles.weight_push import WeightPusher
from pipeline.run_dir import save_run_config
from pipeline.supervise import descendants
from pipeline.tasks import TaskConfig
from support.child_env import child_env

STARTING_GENERATOR = str(Path(__file__).parents[1] / "support" / "starting_generator.py")


def test_a_stalled_start_fails_the_wait_naming_the_generator_and_its_phase():
    wait = ColdStartWait(timeout_s=600, stall_s=30, waiting_for="waiting for 2 generator(s)")
    wait.check([StartStatus("gen-0", "engine", 80.0, 29.0), StartStatus("gen-1", "starting", 3.0, 0.5)])
    with pytest.raises(TimeoutError, match=r"gen-1's engine start made no progress for 31s .*'warm-up' at 7\.0 CPU"):
        wait.check([StartStatus("gen-0", "engine", 90.0, 0.0), StartStatus("gen-1", "warm-up", 7.0, 31.0)])


def test_progress_extends_the_deadline_and_silence_keeps_the_plain_timeout():
    wait = ColdStartWait(timeout_s=0.0, stall_s=30, waiting_for="waiting for 1 generator(s)")
    wait.check([StartStatus("gen-0", "engine", 1.0, 0.0)])  # past run.timeout_s, but progressing
    with pytest.raises(TimeoutError, match="no generator reported start progress within run.timeout_s=0s"):
        time.sleep(0.01)
        wait.check([])


def start_run(run_dir: Path, timeout_s: float, stall_s: float) -> tuple[TokenflowConfig, subprocess.Popen]:
    run_dir.mkdir(parents=True)
    cfg = TokenflowConfig(run=RunConfig(name="t", dir=str(run_dir), timeout_s=timeout_s),
                          task=TaskConfig(name="synthetic", eval_size=10),
                          generator=GeneratorConfig(start_stall_s=stall_s))
    save_run_config(run_dir, cfg)
    orch = subprocess.Popen([sys.executable, "-m", "pipeline.apps.orchestrator", str(run_dir)],
                            stdout=open(run_dir / "orch.log", "w"), stderr=subprocess.STDOUT, env=child_env())
    read_rendezvous(run_dir, 30)
    return cfg, orch


def leader(cfg: TokenflowConfig, run_dir: Path) -> WeightPusher:
    link = TrainerLink(run_dir, record_schema(cfg), timeout_s=10)
    return WeightPusher(cfg=cfg, run_dir=run_dir, rendezvous=None, link=link, trainer=None, rank=0, world=1,
                        host="127.0.0.1", stop_requested=threading.Event())


def end(*procs: subprocess.Popen) -> None:
    for p in procs:
        for pid in descendants(p.pid):
            subprocess.run(["kill", "-CONT", str(pid)], check=False)
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_the_first_group_wait_fails_on_a_stopped_engine_and_outlasts_the_timeout_of_a_progressing_one(tmp_path):
    """~15 s: two runs, each an orchestrator and one starting generator."""
    # A stopped engine: run.timeout_s far away, the stall window (2 s) ends the wait, naming it.
    cfg, orch = start_run(tmp_path / "stalled", timeout_s=600, stall_s=2)
    gen = subprocess.Popen([sys.executable, STARTING_GENERATOR, cfg.run.dir, "--id=0", "--start-s=600"],
                           env=child_env())
    try:
        pusher = leader(cfg, Path(cfg.run.dir))
        while not pusher.link.membership(10).starting:  # it reports before we stop its engine
            time.sleep(0.2)
        while not descendants(gen.pid):
            time.sleep(0.05)
        for pid in descendants(gen.pid):
            subprocess.run(["kill", "-STOP", str(pid)], check=True)
        with pytest.raises(TimeoutError) as err:
            while pusher.await_generators(1) is None:
                pass
        assert "generator gen-0's engine start made no progress" in str(err.value)
        assert "generator.start_stall_s=2" in str(err.value) and "phase: 'engine'" in str(err.value)
    finally:
        end(gen, orch)
    # A slow engine (6 s of CPU work) against run.timeout_s 3 s: waited for. Its stall window is 8 s, since a
    # loaded machine can leave a progressing process without a CPU slice for a couple of seconds.
    cfg, orch = start_run(tmp_path / "slow", timeout_s=3, stall_s=8)
    gen = subprocess.Popen([sys.executable, STARTING_GENERATOR, cfg.run.dir, "--id=0", "--start-s=6"],
                           env=child_env())
    try:
        pusher = leader(cfg, Path(cfg.run.dir))
        while (members := pusher.await_generators(1)) is None:
            pass
        assert members == {"gen-0": 1}
        assert gen.poll() is None, "the generator stays a member until stopped"
    finally:
        end(gen, orch)
    assert gen.returncode == 0 and orch.returncode is not None
