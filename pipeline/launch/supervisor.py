"""The supervisor every task runs: the role in a child process, restarted in place, nothing left behind.

A task (`python -m pipeline.apps.launch_task`, or submitit's call of `RoleDispatcher`) does not run its role
itself: it becomes a child subreaper and starts the role as a child process (`ROLE_PROCESS_ENV`
set, so the child runs the role entry; see `pipeline.launch.task`). Then:

- the child exits 0 -> the task is done (its result file is the child's);
- the child dies otherwise (an exception, ``kill -9``, an engine crash that took it down) -> if the
  component allows restarts (`ComponentSpec.max_restarts`) and none of the stop signals came, the
  role is started again at once: every process the dead one left in the task's tree (vLLM
  engines, an orchestrator) gets SIGKILL (nothing owns them; their sockets close, so a broadcast
  to them fails at once), ``on_restart``, if given, tells the run the dead one is gone (a
  generator's leases are re-issued at once), the new role starts, and only then are the killed
  ones waited for; otherwise they are ended (`end_tree`) before the task goes on; past the
  bound an `optional` component's task *abandons* (result
  ``{"ok": false, "abandoned": true}``, exit 0: the run goes on without it), any other task fails
  (exit 1: the launcher, or ``srun --kill-on-bad-exit``, ends the run);
- SIGTERM (preemption, ``scancel``, the local launcher stopping a run) and the checkpoint signal
  (USR2) are forwarded to the child, which stops at its next step boundary; no restart follows,
  and the task exits 0 however the child ended (a preempted job must not look failed: ``srun
  --kill-on-bad-exit`` would end the trainer's checkpoint). On the checkpoint signal, under
  submitit, global rank 0 requeues the job once the child exited (at most ``stop_grace_s`` later)
  and every task waits for that requeue. SIGTERM never requeues: Slurm requeues a preempted job
  itself (``PreemptMode=REQUEUE``), and ``scancel`` must stay a cancel. Slurm requeues a preempted
  job only if it is still running when its grace time ends (one that exits first is COMPLETED), so
  under Slurm a task stopped by SIGTERM stays alive after its role returned, up to
  ``term_linger_s``, for Slurm to end it: preemption then requeues the job, ``scancel`` (SIGKILL
  after KillWait) cancels it;
- the child gets SIGTERM if the supervisor dies (parent-death signal) and, being a subreaper
  itself, ends its own tree on the way out.

Example: generator.1 with max_restarts=2. Its engine core is killed at 12:00:00; the role raises
(EngineDeadError) and exits 1; the supervisor starts the role again (restart 1 of 2, logged in
``logs/generator.1.out``) and SIGKILLs the orphaned engine worker; the new role joins the weight
group and takes work once it holds the current weights.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

from pipeline.supervise import (become_subreaper, descendants, die_with_parent, end_processes, end_tree,
                                is_resource_tracker, own, signal_note)

class RoleFailed(RuntimeError):
    """The task's role died and was not (or no longer) restarted."""


RESTART_NOTICE_WAIT_S = 5.0
"""How long a restart waits for ``on_restart`` (a generator's `Leave` on behalf of its dead role:
well under a second) before it starts the role anyway."""
ROLE_PROCESS_ENV = "TOKENFLOW_ROLE_PROCESS"
"""Set (to the restart count) in the role's child process: it runs the role instead of supervising."""


class TaskSupervisor:
    def __init__(self, argv: list[str], env: Mapping[str, str], result_file: Path, max_restarts: int,
                 optional: bool, stop_grace_s: float, requeue: Callable[[], None] | None,
                 wait_for_requeue: bool, kill_grace_s: float = 10.0, term_linger_s: float = 600.0,
                 on_restart: Callable[[], None] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        self.argv, self.env, self.result_file = argv, dict(env), result_file
        self.max_restarts, self.optional = max_restarts, optional
        self.stop_grace_s, self.requeue, self.kill_grace_s = stop_grace_s, requeue, kill_grace_s
        self.wait_for_requeue = wait_for_requeue  # under submitit: a checkpoint stop ends in a requeue
        self.term_linger_s = term_linger_s  # under submitit: after a SIGTERM stop, wait this long for Slurm's kill
        self.child: subprocess.Popen | None = None
        self.stop_signal: int | None = None
        self.restarts = 0
        self.requeue_thread: threading.Thread | None = None
        self.on_restart = on_restart  # tells the run the dead role is gone, before its successor starts
        self.pass_fds = pass_fds  # kept open here, inherited by every role process (`mpi_bootstrap`'s listener)

    def _on_signal(self, sig: int, frame) -> None:
        first = self.stop_signal is None
        self.stop_signal = sig if first else self.stop_signal
        signal_note(f"tokenflow supervisor: {signal.Signals(sig).name} at {time.strftime('%H:%M:%S')}: "
                    f"forwarding to the role (no restart)")
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(sig)
        if first and sig != signal.SIGTERM and self.requeue is not None:
            self.requeue_thread = threading.Thread(target=self._requeue_after_child, name="requeue", daemon=True)
            self.requeue_thread.start()

    def _requeue_after_child(self) -> None:
        deadline = time.monotonic() + self.stop_grace_s
        while self.child is not None and self.child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        self.requeue()  # submitit: dumps the checkpointed dispatcher, scontrol requeue (ends every task)

    def run(self, stop_signals: tuple[int, ...]) -> int:
        """Supervise until the role is done; returns the task's exit code."""
        become_subreaper()
        for sig in stop_signals:
            signal.signal(sig, self._on_signal)
        orphans: list[int] = []
        while True:
            for pid in orphans:  # what the dead role left has no owner: SIGKILL now, its sockets close
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._report_left(orphans)
            if self.restarts and self.on_restart is not None:
                self._notify_restart()
            env = {**self.env, ROLE_PROCESS_ENV: str(self.restarts)}
            self.child = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL,
                                          preexec_fn=die_with_parent, pass_fds=self.pass_fds)
            own(self.child.pid)
            if orphans:  # waited for (the kernel frees their memory) while the new role starts
                end_processes(orphans, grace_s=0)
                orphans = []
            code = self._wait_child()
            if self.requeue_thread is not None:  # its `scontrol requeue` is ours, not a leftover of the role
                self.requeue_thread.join(timeout=self.stop_grace_s + 90)
            restart = code != 0 and self.stop_signal is None and self.restarts < self.max_restarts
            if restart:  # what the dead role left: SIGKILLed before its successor starts, waited for after
                orphans = [p for p in descendants(os.getpid()) if not is_resource_tracker(p)]
            else:
                self._report_left(end_tree(grace_s=self.kill_grace_s))
            if code == 0:
                return self._after_success()
            why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            if self.stop_signal is not None:  # asked to stop: ending badly now is no failure of the run
                self._record_death(why)
                return self._linger_after_sigterm()
            if restart:
                self.restarts += 1
                print(f"tokenflow supervisor: role process {self.child.pid} died ({why}); restart "
                      f"{self.restarts} of {self.max_restarts} at {time.strftime('%H:%M:%S')}", flush=True)
                continue
            self._record_death(why)
            if self.optional:
                print(f"tokenflow supervisor: role died ({why}) after {self.restarts} restart(s): "
                      f"abandoned, the run goes on without it", flush=True)
                return 0
            return 1

    def _notify_restart(self) -> None:
        """Run ``on_restart`` before the role starts again, at most `RESTART_NOTICE_WAIT_S` (it goes
        on in the background after that); a failure is logged, never raised."""
        def notify() -> None:
            try:
                self.on_restart()
            except Exception as exc:  # the run notices the death later by itself (silence)
                print(f"tokenflow supervisor: could not announce the dead role ({exc!r})", flush=True)

        thread = threading.Thread(target=notify, name="restart-notice", daemon=True)
        thread.start()
        thread.join(RESTART_NOTICE_WAIT_S)

    @staticmethod
    def _report_left(left: list[int]) -> None:
        if left:
            print(f"tokenflow supervisor: ended {len(left)} process(es) the role left behind: {left}", flush=True)

    def _wait_child(self) -> int:
        while True:
            try:
                return self.child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue

    def _after_success(self) -> int:
        stopped = _read(self.result_file).get("stopped", False)
        if stopped and self.wait_for_requeue and self.stop_signal != signal.SIGTERM:
            time.sleep(self.stop_grace_s + 120)  # the requeue thread ends this task long before
            print("tokenflow supervisor: stopped for requeue but the job was not requeued", flush=True)
            return 1
        return self._linger_after_sigterm() if stopped else 0

    def _linger_after_sigterm(self) -> int:
        """Under Slurm, after a SIGTERM stop: stay until Slurm ends the task (see the module docstring)."""
        if self.wait_for_requeue and self.stop_signal == signal.SIGTERM:
            print(f"tokenflow supervisor: role stopped after SIGTERM; waiting up to {self.term_linger_s:g} s "
                  f"for Slurm to requeue (preemption) or cancel the job", flush=True)
            time.sleep(self.term_linger_s)
            print("tokenflow supervisor: Slurm did not end the job after SIGTERM; exiting", flush=True)
        return 0

    def _record_death(self, why: str) -> None:
        """Write the task's result when the role could not (killed), or mark it abandoned."""
        record = _read(self.result_file)
        if not record or record.get("ok"):
            record = {"ok": False, "error": f"role process {self.child.pid} died ({why}) without a result\n"}
        record.update(restarts=self.restarts, abandoned=self.optional and self.stop_signal is None,
                      stopped_by=signal.Signals(self.stop_signal).name if self.stop_signal else None)
        tmp = self.result_file.with_name(f".{self.result_file.name}.tmp")
        tmp.write_text(json.dumps(record, default=str))
        os.replace(tmp, self.result_file)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def role_argv(run_dir: Path, launch_index: int) -> list[str]:
    return [sys.executable, "-u", "-m", "pipeline.apps.launch_task", str(run_dir), str(launch_index)]
