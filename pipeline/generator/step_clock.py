"""The engine's own view of a weight update's stall: the gap between engine steps around the swap.

Installed in an engine worker (`WeightSyncExtension.load_version`): it wraps the worker's
``execute_model`` and ``sample_tokens`` (the two calls of one engine step) to note when each step
ends. A swap marks the end of the last step before it; the next step's start closes the gap. So a
gap is exactly the time the engine ran no step because of the update: the driver's pause reaching
the engine core, the swap, the relabel and the resume reaching it again. The step in progress when
the update arrived is not part of it (it produced tokens), unlike the driver's pause-to-resume
(`UpdateReport.paused_s`), which starts before that step ends. Worked example: steps end at 100 ms,
the swap runs at 101-102 ms, the resume arrives and the next step starts at 104 ms: gap 4 ms;
the driver, which sent the pause at 90 ms mid-step, saw 14 ms.
"""
from __future__ import annotations

import time
from typing import Any, Callable


class StepClock:
    """Gaps in engine steps around weight swaps (seconds), in swap order until `take`n."""

    def __init__(self, worker: Any):
        self.last_end: float | None = None
        self.swap_from: float | None = None
        self.gaps: list[float] = []
        for name in ("execute_model", "sample_tokens"):  # instance attributes shadow the class's methods
            setattr(worker, name, self._timed(getattr(worker, name)))

    def _timed(self, call: Callable) -> Callable:
        def step(*args, **kwargs):
            if self.swap_from is not None:
                self.gaps.append(time.monotonic() - self.swap_from)
                self.swap_from = None
            try:
                return call(*args, **kwargs)
            finally:
                self.last_end = time.monotonic()
        return step

    def swapped(self) -> None:
        """A swap ran: the gap runs from the end of the last step (if one ran since the last swap)."""
        if self.last_end is not None and self.swap_from is None:
            self.swap_from = self.last_end

    def take(self) -> list[float]:
        gaps, self.gaps = self.gaps, []
        return gaps
