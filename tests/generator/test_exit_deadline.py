"""A weight-group member with a staged receive posted ends soon after SIGTERM, so a broadcast to it
fails instead of waiting (`pipeline.generator.exit_deadline`). Real gloo groups, real processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from pipeline.launch.rendezvous import free_port
from pipeline.weights.group import TorchDistChannel, WeightSyncError

REPO = Path(__file__).resolve().parents[2]

MEMBER = r"""
import atexit, signal, sys, threading, time
from pipeline.generator.exit_deadline import bound_exit_after_stop_signal
from pipeline.weights.group import TorchDistChannel

def like_vllm(signum, frame):  # vLLM's worker: SystemExit once, then its shutdown
    print("shutting down", flush=True)
    raise SystemExit(3)

if sys.argv[3] != "default":
    signal.signal(signal.SIGTERM, like_vllm)
if sys.argv[2] != "plain":
    assert bound_exit_after_stop_signal()
    assert not bound_exit_after_stop_signal()  # once per process
channel = TorchDistChannel("127.0.0.1", int(sys.argv[1]), rank=1, world_size=2, timeout_s=60)
if sys.argv[3] == "stuck":  # a teardown that does not finish (the leaving worker of docs/generator-jobs.md)
    atexit.register(time.sleep, 3600)
threading.Thread(target=lambda: list(channel.receive(stage=True)), daemon=True).start()  # as start_receiving
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _member(port: int, bounded: str, teardown: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", MEMBER, str(port), bounded, teardown],
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def _stop_and_broadcast(bounded: str, teardown: str,
                        patience_s: float = 30) -> tuple[int | None, str, BaseException | None]:
    """Form a group with a member that posted a staged receive, SIGTERM it, broadcast to it: its exit
    status (None: alive after ``patience_s``), what it printed after the signal, and what the
    broadcast raised."""
    port = free_port()
    member = _member(port, bounded, teardown)
    try:
        sender = TorchDistChannel("127.0.0.1", port, rank=0, world_size=2, timeout_s=60)
        assert member.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # the receive is posted
        member.send_signal(signal.SIGTERM)
        try:
            code = member.wait(patience_s)
        except subprocess.TimeoutExpired:
            code = None
        said = member.stdout.read() if code is not None else ""
        error: list[BaseException] = []
        if code is not None:
            def send() -> None:
                try:
                    sender.send_tensors(1, [("w", torch.ones(8))], 1 << 20)
                except BaseException as e:
                    error.append(e)
            t = threading.Thread(target=send, daemon=True)
            t.start()
            t.join(30)
            assert not t.is_alive(), "the broadcast to an ended member neither failed nor completed"
        return code, said, (error[0] if error else None)
    finally:
        if member.poll() is None:
            member.kill()
            member.wait()


def test_a_member_whose_shutdown_does_not_finish_ends_at_the_deadline_and_the_broadcast_to_it_fails():
    code, said, error = _stop_and_broadcast("bounded", "stuck")
    assert "shutting down" in said  # vLLM's handler ran: its shutdown began
    assert code == -signal.SIGALRM, code  # and did not finish: the deadline ended the process
    assert isinstance(error, WeightSyncError), error


def test_without_the_deadline_that_member_stays_and_a_broadcast_would_wait_for_it():
    code, said, _ = _stop_and_broadcast("plain", "stuck", patience_s=5)
    assert code is None, (code, said)


def test_a_default_sigterm_still_ends_the_member():
    code, _, error = _stop_and_broadcast("bounded", "default")
    assert code == -signal.SIGTERM, code
    assert isinstance(error, WeightSyncError), error


def test_an_ignored_sigterm_stays_ignored():
    from pipeline.generator.exit_deadline import bound_exit_after_stop_signal

    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert not bound_exit_after_stop_signal()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
