"""Environments in separate processes (`pipeline.envs.remote`, `pipeline.envs.server`): real
processes, real ZeroMQ sockets, the episode loop's own timeout helper.

An environment process answers exactly as the environment would in the generator process; a hung
step costs only its episode while the same process serves the others; a killed process fails the
step it was serving and is restarted; a bad frame gets an error naming it; the processes end with
a killed owner.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from support.chaos import wait_for
from pipeline.envs import CalculatorEnv, EnvironmentError_, Step, step_with_timeout
from pipeline.envs.remote import EnvironmentPool
from pipeline.supervise import alive


@pytest.fixture
def pool():
    p = EnvironmentPool(1, step_timeout_s=1.0, max_restarts=3)
    yield p
    p.close()


def test_calculator_in_an_environment_process_answers_as_in_process(pool):
    script = ["calc 37*48", "calc 2+3*4", "calc 2**9", "calc 999999999999*999999999999", "1776"]
    remote, local = pool.environment("calculator"), CalculatorEnv()
    remote.reset("37*48=")
    got = [remote.step(m) for m in script]
    remote.close()
    assert got == [local.step(m) for m in script]
    assert got[-1] == Step("", 0.0, True) and "=1776" in got[0].observation


def test_a_hung_step_costs_only_its_episode_while_the_process_serves_others(pool):
    hung, other = pool.environment("support.envs:Sleepy"), pool.environment("support.envs:Sleepy")
    hung.reset("x")
    other.reset("y")

    async def both():
        t0 = time.monotonic()
        stuck = asyncio.ensure_future(step_with_timeout(hung, "hang", 1.0))
        answers = [await step_with_timeout(other, str(i), 1.0) for i in range(5)]
        with pytest.raises(EnvironmentError_, match="longer than 1.0 s"):
            await stuck
        return answers, time.monotonic() - t0

    answers, took = asyncio.run(both())
    assert answers == [Step(f"={i}", 0.5, False) for i in range(5)]
    assert took < 30, "the hung step's 60 s sleep held the episode loop"
    assert pool.restarts == 0  # the process kept serving; only the episode was lost
    assert other.step("done") == Step("=done", 0.5, True)


def test_a_killed_environment_process_fails_its_step_and_is_restarted(pool):
    env = pool.environment("support.envs:Sleepy")
    env.reset("x")
    pid = pool.kept[0].proc.pid

    async def killed_mid_step():
        step = asyncio.ensure_future(step_with_timeout(env, "hang", 1.0))
        await asyncio.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EnvironmentError_):
            await step

    asyncio.run(killed_mid_step())
    wait_for(lambda: pool.restarts == 1 and pool.kept[0].proc.pid != pid, 10, "the process restarted")
    fresh = pool.environment("calculator")
    fresh.reset("2+2=")
    assert fresh.step("calc 2+2") == CalculatorEnv().step("calc 2+2")


def test_bad_frames_and_unknown_environments_get_errors_naming_them(pool):
    import zmq

    from pipeline.protocol.wire import decode

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pool.addresses[0])
    try:
        sock.send_multipart([b"not a message"])
        assert sock.poll(10_000), "no answer to a bad frame"
        msg = decode(pool.secret, sock.recv_multipart(), 1 << 20)
        assert msg.kind == "error" and "bad request frame" in msg.meta["error"]
    finally:
        sock.close()
    env = pool.environment("nosuch.module:Env")
    with pytest.raises(RuntimeError, match="cannot be imported"):
        env.reset("x")
    ok = pool.environment("calculator")  # the process still serves
    ok.reset("1+1=")
    assert ok.step("2").done


def test_environment_processes_end_with_a_killed_owner(tmp_path):
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pipeline.envs.remote import EnvironmentPool\n"
         "p = EnvironmentPool(2, 1.0, 3)\nprint(p.dir, *[k.proc.pid for k in p.kept], flush=True)\n"
         "time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        where, *pids = owner.stdout.readline().split()
        pids = [int(x) for x in pids]
        assert len(pids) == 2 and all(alive(p) for p in pids) and os.path.isdir(where)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        wait_for(lambda: not any(alive(p) for p in pids), 15, "the environment processes ended")
        wait_for(lambda: not os.path.exists(where), 5, f"the pool's socket directory {where} removed")
    finally:
        owner.kill()
        owner.wait()
