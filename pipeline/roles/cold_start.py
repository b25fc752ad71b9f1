"""The deadline of a wait on starting generators: extended by their progress, ended by a stall.

A cold vLLM engine's start (loading, compilation, graph capture, a warm-up) has no useful upper
bound, so the trainer's waits on it (the first weight group: `pipeline.roles.weight_push`) are not
bounded by one global timeout but by the start progress each starting generator reports through
the orchestrator (`pipeline.protocol.messages.StartProgress`, `Members.starting`).

Invariants:
- a starting generator whose progress stopped for more than ``generator.start_stall_s`` fails the
  wait at once, with a message naming it, its last phase and its CPU seconds;
- while any starting generator progresses, the deadline is ``run.timeout_s`` after now (it extends);
  with none starting (none reports: not started yet, or an orchestrator restarted meanwhile), the
  wait ends ``run.timeout_s`` after its last extension, as before.

Example: ``run.timeout_s`` 600, ``start_stall_s`` 120: an engine that compiles for 25 minutes,
its CPU seconds growing, is waited for; one stopped (SIGSTOP) after 3 minutes of loading fails the
wait about 2 minutes later naming ``gen-0`` and phase ``engine``.
"""
from __future__ import annotations

import time

from pipeline.protocol.messages import StartStatus


class ColdStartWait:
    """One wait on starting generators (see the module docstring)."""

    def __init__(self, timeout_s: float, stall_s: float, waiting_for: str):
        self.timeout_s, self.stall_s, self.waiting_for = timeout_s, stall_s, waiting_for
        self.deadline = time.monotonic() + timeout_s

    def check(self, starting: list[StartStatus]) -> None:
        """Raise `TimeoutError` if a starting generator stalled or the deadline passed; else extend
        the deadline when one progresses."""
        for s in starting:
            if s.quiet_s > self.stall_s:
                raise TimeoutError(f"{self.waiting_for}: generator {s.identity}'s engine start made no progress "
                                   f"for {s.quiet_s:.0f}s (generator.start_stall_s={self.stall_s:g}); its last "
                                   f"phase: {s.phase!r} at {s.cpu_s:.1f} CPU seconds of its process tree; "
                                   f"see logs/generator.*.out")
        now = time.monotonic()
        if starting:
            self.deadline = max(self.deadline, now + self.timeout_s)
        elif now > self.deadline:
            raise TimeoutError(f"{self.waiting_for}: no generator reported start progress "
                               f"within run.timeout_s={self.timeout_s:g}s")
