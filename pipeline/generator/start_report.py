"""A starting generator's heartbeat: `StartProgress` to the orchestrator each second until its Hello.

A cold vLLM engine (loading, compilation, graph capture, a warm-up) may take many minutes; the
trainer's waits on it extend while it progresses and fail once it stops
(``generator.start_stall_s``, `pipeline.roles.cold_start`). Progress is a fact of the engine's
process tree, not of this process: the CPU seconds (user + system, reaped children included) of
every live descendant of the generator process; while none exists yet (phase ``starting``:
imports, the model's config) the generator process's own CPU seconds. A stopped or hung engine
(SIGSTOP, a deadlock) uses none, so its reports stop growing; this thread's own work is never
counted once the engine exists.

Invariants:
- the reports go out on this thread's own socket, under the identity ``gen-<id>-start`` (the
  generator's ``gen-<id>`` link opens only at its Hello, after `stop`);
- `stop` ends the thread (waiting for the orchestrator's address included) and closes its socket
  before it returns;
- a report that cannot be measured (a process ended while being read) is skipped, never sent wrong.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import psutil

from pipeline.protocol import messages as m
from pipeline.protocol.links import read_rendezvous
from pipeline.protocol.transport import MessageClient, TransportConfig, TransportError, load_or_create_secret
from pipeline.supervise import descendants

log = logging.getLogger(__name__)

REPORT_EVERY_S = 1.0
"""How often a starting generator reports its progress."""


def tree_cpu_s(root: int) -> tuple[float, bool]:
    """CPU seconds of ``root``'s live descendants and whether any exists; ``root``'s own when none."""
    total, pids = 0.0, descendants(root)
    for pid in pids or [root]:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total, bool(pids)


class StartReporter:
    """Reports ``phase`` (set by the generator as it goes) and its engine tree's CPU seconds."""

    def __init__(self, run_dir: Path, generator_id: int, transport: TransportConfig, timeout_s: float):
        self.run_dir, self.generator_id, self.transport, self.timeout_s = run_dir, generator_id, transport, timeout_s
        self.phase = "starting"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="start-report", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        address = None
        while address is None:  # the orchestrator may not have published its address yet
            try:
                address = read_rendezvous(self.run_dir, 0.0)["address"]
            except TransportError:
                if self._stop.wait(REPORT_EVERY_S):
                    return
        client = MessageClient(load_or_create_secret(self.run_dir), address, self.transport,
                               f"gen-{self.generator_id}-start")
        try:
            while True:
                cpu_s, engine = tree_cpu_s(os.getpid())
                phase = self.phase if engine or self.phase != "engine" else "starting"
                try:
                    client.send(*m.encode(m.StartProgress(self.generator_id, phase, cpu_s)), timeout_s=REPORT_EVERY_S)
                except TransportError as exc:
                    log.warning("start progress report not sent: %s", exc)
                if self._stop.wait(REPORT_EVERY_S):
                    break
        finally:
            client.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s)
