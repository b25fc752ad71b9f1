"""`StepClock`: the engine's own stall per weight swap, from the engine steps around it (no engine
needed: a worker object whose step calls advance a manual clock)."""
from __future__ import annotations

import pytest

import pipeline.generator.step_clock as step_clock


class _Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class _Worker:
    """Stands in for vLLM's worker: one engine step is execute_model then sample_tokens."""

    def __init__(self, clock: _Clock):
        self.clock, self.calls = clock, []

    def execute_model(self, scheduler_output):
        self.calls.append(("execute_model", scheduler_output))
        self.clock.now += 0.020  # the forward pass
        return None

    def sample_tokens(self, grammar_output):
        self.calls.append(("sample_tokens", grammar_output))
        self.clock.now += 0.005
        return "output"


def _step(worker, n):
    worker.execute_model(n)
    return worker.sample_tokens(n)


def test_a_gap_runs_from_the_end_of_the_last_step_before_a_swap_to_the_start_of_the_next(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(step_clock, "time", clock)
    worker = _Worker(clock)
    clock_ = step_clock.StepClock(worker)
    assert _step(worker, 1) == "output"  # steps still run and return through the clock
    assert worker.calls == [("execute_model", 1), ("sample_tokens", 1)]
    clock.now += 0.010  # the pause reaches the engine core
    clock_.swapped()
    clock.now += 0.003  # relabel and resume round trip
    clock_.swapped()  # a second swap before any step keeps the gap's start
    _step(worker, 2)
    assert clock_.take() == [pytest.approx(0.013)]  # not the step in progress, nor the step after
    assert clock_.take() == []


def test_no_gap_before_any_step_ran(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(step_clock, "time", clock)
    worker = _Worker(clock)
    clock_ = step_clock.StepClock(worker)
    clock_.swapped()
    _step(worker, 1)
    assert clock_.take() == []

