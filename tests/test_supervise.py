"""Supervision without models: the task supervisor restarts a role killed with SIGKILL and ends
what it left behind; past the bound an optional task abandons and the run goes on; a stop signal
is forwarded and never followed by a restart; a kept process is restarted, then given up on."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pipeline.launch import ComponentSpec, JobPlan, LocalLauncher, TaskFailed
from pipeline.supervise import KeptProcess, MARKER_ENV, alive, die_with_parent
from support.leftovers import leftovers

PROBE = "pipeline.launch.probe:probe"


def plan(max_restarts: int, optional: bool, **probe) -> JobPlan:
    return JobPlan(name="sup", components={
        "trainer": ComponentSpec(entry=PROBE),
        "generator": ComponentSpec(entry=PROBE, max_restarts=max_restarts, optional=optional)},
        config={"probe": {"timeout_s": 60, "crash_role": "generator", **probe}})


def test_a_killed_role_is_restarted_and_what_it_left_is_ended(tmp_path):
    run = LocalLauncher(kill_grace_s=5).launch(plan(max_restarts=2, optional=True, crash_times=2), tmp_path / "run")
    results = run.wait(timeout_s=120)
    assert results["generator"][0]["role"] == "generator"  # the third start completed
    reports = [json.loads((tmp_path / f"run/probe/generator.0.restart-{k}.json").read_text()) for k in range(3)]
    assert [alive(r["child_pid"]) for r in reports[:2]] == [False, False], "an orphan outlived its dead role"
    log = (tmp_path / "run/logs/generator.0.out").read_text()
    assert "restart 1 of 2" in log and "restart 2 of 2" in log and "left behind" in log


def test_past_its_restarts_an_optional_task_abandons_and_the_run_goes_on(tmp_path):
    run = LocalLauncher(kill_grace_s=5).launch(plan(max_restarts=1, optional=True, crash_times=5), tmp_path / "run")
    results = run.wait(timeout_s=120)
    assert results["generator"] == [None] and results["trainer"][0]["role"] == "trainer"
    record = json.loads((tmp_path / "run/results/generator.0.json").read_text())
    assert record["abandoned"] and record["restarts"] == 1 and "SIGKILL" in record["error"]


def test_past_its_restarts_a_required_task_fails_the_run(tmp_path):
    launched = LocalLauncher(kill_grace_s=5).launch(plan(max_restarts=0, optional=False), tmp_path / "run")
    with pytest.raises(TaskFailed, match="generator.0 failed: role process .* died \\(signal SIGKILL\\)"):
        launched.wait(timeout_s=120)


def test_sigterm_is_forwarded_as_a_stop_and_never_restarts(tmp_path):
    p = plan(max_restarts=3, optional=True, hold_s=120)
    p.config["probe"].pop("crash_role")
    p.components.pop("generator")
    launched = LocalLauncher(kill_grace_s=5).launch(p, tmp_path / "run")
    deadline = time.monotonic() + 60
    while not list((tmp_path / "run/probe").glob("trainer.0.*.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(launched.pids[0], signal.SIGTERM)  # the supervisor only, as Slurm's preemption would too
    results = launched.wait(timeout_s=60)
    assert results["trainer"][0]["stop_requested"] is True
    record = json.loads((tmp_path / "run/results/trainer.0.json").read_text())
    assert record["stopped"] and record["restart"] == 0
    assert "SIGTERM received" in (tmp_path / "run/logs/trainer.0.out").read_text()


SECOND_SIGTERM_INSIDE_THE_FIRST = """
import os, signal, threading, time
from pipeline.launch.task import StopWatcher
event = threading.Event()
watcher = StopWatcher(event)
real_stop, calls = watcher._stop, []
def stop_then_hear_it_again(sig):  # the group's SIGTERM handled; the supervisor's forward lands inside
    calls.append(sig)
    if len(calls) > 1:
        return real_stop(sig)
    with watcher._lock:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the nested handler runs at the next bytecode, in this same thread
        real_stop(sig)
watcher._stop = stop_then_hear_it_again
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("stopped" if event.is_set() else "not stopped", flush=True)
"""


def test_a_second_sigterm_inside_the_stop_handler_neither_deadlocks_nor_raises():
    # `tokenflow cancel` signals the task's process group and the supervisor forwards the same
    # SIGTERM to the role: two handlers, the second inside the first (a CI run hung here for 90 s).
    out = subprocess.run([sys.executable, "-c", SECOND_SIGTERM_INSIDE_THE_FIRST], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("SIGTERM received") == 1 and out.stdout.strip().endswith("stopped"), out.stdout


def test_a_task_stopped_by_a_signal_is_not_named_as_the_cause(tmp_path):
    # the failing task and its victim both leave a failed result; the error names the cause even
    # when the victim comes first in the layout
    p = plan(max_restarts=0, optional=False, fail_role="generator")
    p.config["probe"].pop("crash_role")
    run = LocalLauncher(kill_grace_s=5).launch(p, tmp_path / "run")
    victim = {"ok": False, "error": "role process 1 died (signal SIGTERM) without a result\n",
              "restarts": 0, "abandoned": False, "stopped_by": "SIGTERM"}
    while not run.done():
        time.sleep(0.2)
    (tmp_path / "run/results/trainer.0.json").write_text(json.dumps(victim))
    with pytest.raises(TaskFailed, match="task generator.0 failed: RuntimeError: probe: role generator was told"):
        run.wait(timeout_s=5)


def test_a_kept_process_is_restarted_then_given_up_on(tmp_path):
    given_up = []
    starts = []

    def start():
        starts.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        return starts[-1]

    kept = KeptProcess("sleeper", start, max_restarts=2, on_give_up=given_up.append, poll_s=0.05)
    for _ in range(3):
        pid = kept.proc.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while kept.proc.pid == pid and not given_up and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(starts) == 3 and kept.restarts == 2
    assert given_up and "the sleeper" in given_up[0] and "SIGKILL" in given_up[0]
    kept.stop()


def test_a_restarted_kept_process_outlives_its_release_though_it_dies_with_its_parent():
    """Regression: a restart is forked by the watcher thread, and the parent-death signal follows
    the forking thread; the watcher ended at `release`, so the restarted orchestrator got SIGINT
    at the end of the run (before it was told to finish), possibly still restoring the log. Once
    released, the watcher waits for it at its poll interval (an earlier one spun a core meanwhile)."""
    starts = []

    def start():
        starts.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                       preexec_fn=lambda: die_with_parent(signal.SIGINT)))
        return starts[-1]

    kept = KeptProcess("sleeper", start, max_restarts=1, on_give_up=print, poll_s=0.05)
    try:
        os.kill(starts[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while len(starts) < 2:
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.05)
        polls, poll = [], starts[1].poll
        starts[1].poll = lambda: polls.append(1) or poll()  # the watcher's checks of the released process
        kept.release()
        time.sleep(1.0)
        assert poll() is None, f"the restarted process died at release ({starts[1].returncode})"
        # it waits at its poll interval (~20 checks in 1 s), not in a loop whose wait returns at once
        assert len(polls) < 100, f"the released watcher spun: {len(polls)} checks in 1 s"
    finally:
        kept.stop()
    assert starts[1].returncode is not None


def test_leftovers_finds_marked_processes_wherever_they_were_reparented():
    marker = os.environ[MARKER_ENV]
    orphan = subprocess.run([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen("
                             "[sys.executable, '-c', 'import time; time.sleep(600)'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
                            capture_output=True, text=True, timeout=60)
    pid = int(orphan.stdout)  # its parent exited: it was reparented away from this test's tree
    assert pid in leftovers(marker, wait_s=0.5)  # found, and killed
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


def test_ending_a_tree_gives_up_on_a_process_that_outlives_sigkill_and_names_it(capsys):
    """A process blocked in the kernel (uninterruptible sleep on a dead network filesystem) outlives
    SIGKILL; `end_tree` must not wait for it forever. Such a process cannot be made on demand here
    (FUSE waits are killable), so the process list is a real child that a stale list keeps
    naming after SIGKILL ended it: the same view `_end` would have of a stuck process."""
    from pipeline.supervise import _end

    child = subprocess.Popen(["sleep", "60"])
    try:
        t0 = time.monotonic()
        signalled = _end(lambda: [child.pid], grace_s=0.2, kill_wait_s=0.5)
        took = time.monotonic() - t0
        assert signalled == [child.pid]
        assert not alive(child.pid)  # the child itself was ended (and reaped as an adopted zombie)
        assert 0.7 <= took < 5, took
        err = capsys.readouterr().err
        assert "outlived SIGKILL" in err and f"{child.pid} (gone" in err, err
    finally:
        child.kill()
        child.wait()


RESTARTED = """
import os, sys
from pathlib import Path
from pipeline.launch.supervisor import TaskSupervisor

log = Path(sys.argv[1])
role = [sys.executable, "-c", "import sys; from pathlib import Path; log = Path(sys.argv[1]); "
        "first = 'start' not in log.read_text(); log.write_text(log.read_text() + 'start\\\\n'); "
        "sys.exit(1 if first else 0)", str(log)]
code = TaskSupervisor(role, os.environ, Path(sys.argv[2]), max_restarts=1, optional=False, stop_grace_s=5,
                      requeue=None, wait_for_requeue=False,
                      on_restart=lambda: log.write_text(log.read_text() + "notice\\n")).run(())
sys.exit(code)
"""


def test_a_restart_is_announced_before_the_role_starts_again(tmp_path):
    """`TaskSupervisor.on_restart` (a generator's `Leave` on behalf of its dead role) runs once per
    restart, after the death and before the new role process starts; never on the first start."""
    log = tmp_path / "log"
    log.write_text("")
    out = subprocess.run([sys.executable, "-c", RESTARTED, str(log), str(tmp_path / "result.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert log.read_text().split() == ["start", "notice", "start"]
