"""Numerical drift fails a test: `tokenflow replay` of the committed golden rollout log (trainer
only: no sampling, so nothing depends on the CPU's instruction set) must reproduce the stored
per-step loss and grad norm within 1e-4. The golden files and how to regenerate them:
`tests/support/golden/make_golden.py`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "support" / "golden"))
import make_golden  # noqa: E402

pytestmark = pytest.mark.engine

TOLERANCE = 1e-4


def test_replay_of_the_golden_log_reproduces_the_stored_curve(tmp_path):
    if not make_golden.CURVE.exists():
        pytest.skip(f"{make_golden.CURVE} is not generated yet: run tests/support/golden/make_golden.py")
    golden = json.loads(make_golden.CURVE.read_text())
    assert golden["overrides"] == make_golden.REPLAY_OVERRIDES, "curve.json is stale: regenerate it"
    got = make_golden.replay(tmp_path / "replay")
    assert [s["step"] for s in got] == [s["step"] for s in golden["steps"]] == list(range(make_golden.STEPS))
    for want, have in zip(golden["steps"], got):
        for key in ("loss", "grad_norm"):
            assert abs(have[key] - want[key]) <= TOLERANCE, (key, want, have)
    assert any(s["grad_norm"] > 0 for s in got), "the replay did not train"
