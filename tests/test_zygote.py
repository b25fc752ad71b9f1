"""`support.zygote`: workers forked from one preloaded process, with their exit statuses, output
files and deaths as separate processes would have them (real processes, real signals)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

IMPORTED_IN = os.getpid()
"""The process that imported this module: in a worker, the zygote that preloaded it."""


def report(path: str) -> None:
    """A worker: what it is and where its code came from."""
    print("hello from the worker")
    Path(path).write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "imported_in": IMPORTED_IN,
                                      "threads": len(os.listdir("/proc/self/task"))}))


def fail() -> None:
    raise ValueError("the worker's own error")


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def sleep() -> None:
    time.sleep(600)


def _gone(pids: list[int], wait_s: float = 10.0) -> bool:
    from pipeline.supervise import alive

    deadline = time.monotonic() + wait_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def test_workers_run_preloaded_code_with_their_own_output_and_exit_status(tmp_path):
    from support.zygote import Zygote

    with Zygote(["test_zygote"], tmp_path / "zygote.log") as zygote:
        ok = zygote.start("test_zygote:report", {"path": str(tmp_path / "ok.json")}, tmp_path / "ok.log")
        raised = zygote.start("test_zygote:fail", {}, tmp_path / "raised.log")
        killed = zygote.start("test_zygote:kill_self", {}, tmp_path / "killed.log")
        sleeping = zygote.start("test_zygote:sleep", {}, tmp_path / "sleeping.log")
        assert zygote.wait([ok, raised, killed], timeout_s=60) == {ok: 0, raised: 1, killed: -signal.SIGKILL}
        with pytest.raises(TimeoutError, match=str(sleeping)):
            zygote.wait([sleeping], timeout_s=0.2)
        zygote.kill(sleeping)
        assert zygote.wait([sleeping], timeout_s=60) == {sleeping: -signal.SIGKILL}
        zygote_pid = zygote.pid
    got = json.loads((tmp_path / "ok.json").read_text())
    assert got["pid"] == ok and got["ppid"] == zygote_pid and got["threads"] == 1
    assert got["imported_in"] == zygote_pid, "the worker imported its module again"
    assert (tmp_path / "ok.log").read_text() == "hello from the worker\n"
    assert "ValueError: the worker's own error" in (tmp_path / "raised.log").read_text()
    assert _gone([zygote_pid])


def test_zygote_refuses_to_fork_once_an_import_started_a_thread(tmp_path):
    from support.zygote import Zygote

    (tmp_path / "threaded.py").write_text("import threading, time\n"
                                          "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    with Zygote(["threaded"], tmp_path / "zygote.log", env) as zygote:
        with pytest.raises(RuntimeError, match="2 threads; it forks only with one"):
            zygote.start("test_zygote:report", {"path": str(tmp_path / "never.json")}, tmp_path / "never.log")
    assert not (tmp_path / "never.json").exists()


def test_workers_die_with_the_zygote_and_the_zygote_with_its_parent(tmp_path):
    """The parent is SIGKILLed: nothing it started through the zygote is left."""
    tests = Path(__file__).resolve().parent
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys, json, time; from support.zygote import Zygote\n"
         f"z = Zygote(['test_zygote'], {str(tmp_path / 'zygote.log')!r})\n"
         f"pid = z.start('test_zygote:sleep', {{}}, {str(tmp_path / 'w.log')!r})\n"
         "print(json.dumps([z.pid, pid]), flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, cwd=tests,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)])))
    try:
        zygote_pid, worker = json.loads(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    assert _gone([zygote_pid, worker])
