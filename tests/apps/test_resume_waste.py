"""A run whose trainer is SIGKILLed after a checkpoint and resumed with the same command wastes
nothing beyond the rollback itself (real vLLM generator, real megatron trainer, real log).

The kill step is drawn from a seed, printed (``TOKENFLOW_TEST_SEED`` fixes it). From the rollout
log and the metric stream: at most 2 groups wasted as stale (evicted from the buffer or dropped
when scored: an uninterrupted run's level), the
groups dropped by the rollback within (steps since the checkpoint + max_async + 1) x
groups_per_step, no orchestrator metric line with ``kept < 0``, every step trained once, no group
stored twice.
"""
from __future__ import annotations

import json
import os
import random

import pytest

from pipeline.metrics import read_metrics
from support.resume_driver import run_killed_and_resumed, waste

pytestmark = pytest.mark.engine

STEPS, CHECKPOINT_EVERY, GROUPS_PER_STEP, MAX_ASYNC = 16, 4, 4, 1


def resume_point(run_dir, killed_at: float) -> tuple[int, int]:
    """(checkpoint step k the trainer resumed from, last step done before the kill), from the
    ``train_step`` records of the killed run (written before ``killed_at``) and of the resumed one.
    The trainer may have checkpointed the step it was killed in (then k = last + 1 and no step repeats)."""
    records = list(read_metrics(run_dir, "train_step"))
    before = [r["step"] for r in records if r["t"] <= killed_at]
    after = [r["step"] for r in records if r["t"] > killed_at]
    assert before and after, f"steps before the kill {before}, after the resume {after}"
    return after[0], before[-1]


@pytest.mark.slow  # 158 s in CI: two runs with engine starts; tests/apps/test_train_e2e.py resumes a killed run in the default suite
def test_a_trainer_killed_after_a_checkpoint_resumes_without_extra_waste(tmp_path):
    seed = int(os.environ.get("TOKENFLOW_TEST_SEED", random.randrange(1 << 16)))
    kill_after = random.Random(seed).randrange(CHECKPOINT_EVERY + 1, STEPS - 5)
    print(f"seed {seed}: SIGKILL the trainer after step {kill_after}")
    run_dir = tmp_path / "resume"
    killed_at = run_killed_and_resumed(run_dir, STEPS, kill_after)
    got = waste(run_dir)
    print(json.dumps(got))
    k, last = resume_point(run_dir, killed_at)
    assert k % CHECKPOINT_EVERY == 0 and k <= last + 1, (k, last)
    assert got["steps"] == list(range(STEPS)) and got["stored_twice"] == 0
    assert got["evicted_stale"] + got["dropped_stale"] <= 2, got  # an uninterrupted run's level
    assert got["dropped_rollback"] <= (last + 1 - k + MAX_ASYNC + 1) * GROUPS_PER_STEP, (got, k, last)
    assert got["min_kept"] >= 0, got
