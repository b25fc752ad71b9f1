"""Processes a test or benchmark left behind: found by the marker every process it started inherits
(`pipeline.supervise.MARKER_ENV`), wherever they were reparented to, and ended.

Invariants: the caller's own process and its ancestors are never reported (they carry the marker
by design), nor the caller's own multiprocessing resource tracker (a singleton of the caller's
interpreter that exits with it); zombies are not reported (they are already dead).

Example: a test sets ``TOKENFLOW_PROCESS_MARKER=ab12`` and starts a run whose EngineCore is
reparented to init when its generator dies; ``leftovers("ab12", wait_s=0)`` returns
``{pid: "VLLM::EngineCore ..."}`` and SIGKILLs it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from pipeline.supervise import MARKER_ENV


def marked_processes(marker: str, exclude: set[int] = frozenset()) -> dict[int, str]:
    """pid -> command line of every live process whose environment holds ``MARKER_ENV=marker``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = {}
    for pid in psutil.pids():
        if pid in exclude:
            continue
        try:  # the environment read directly: the one check every process of the machine gets
            if needle not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                found[pid] = " ".join(proc.cmdline()).strip()
        except (OSError, psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def leftovers(marker: str, wait_s: float = 15.0, kill: bool = True) -> dict[int, str]:
    """Processes still carrying ``marker`` after up to ``wait_s`` (they may be stopping); SIGKILLed if ``kill``."""
    me = psutil.Process()
    exclude = {me.pid, *(p.pid for p in me.parents())}
    exclude |= {p for p, cmd in marked_processes(marker, exclude).items()
                if "multiprocessing.resource_tracker" in cmd and _parent(p) == os.getpid()}
    deadline = time.monotonic() + wait_s
    found = marked_processes(marker, exclude)
    while found and time.monotonic() < deadline:
        time.sleep(0.5)
        found = marked_processes(marker, exclude)
    if found and kill:
        for pid in found:
            try:
                psutil.Process(pid).kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return found


def _parent(pid: int) -> int:
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return 0
