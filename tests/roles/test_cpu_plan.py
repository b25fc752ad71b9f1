"""The one-machine core plan (``cluster.cpu_plan=auto``) and the lower priority of a generator that
joined on the trainer's cores (`pipeline.roles.common`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import TokenflowConfig
from pipeline.roles import common
from pipeline.roles.common import cpu_cores_for, shares_trainer_cores

REPO = Path(__file__).resolve().parents[2]


def _cfg(generators: int = 1, trainer_ranks: int = 1, plan: str = "auto") -> TokenflowConfig:
    cfg = TokenflowConfig()
    cfg.cluster.generators, cfg.cluster.trainer_ranks, cfg.cluster.cpu_plan = generators, trainer_ranks, plan
    return cfg


@pytest.mark.parametrize("cores, generators, expected", [
    # 2 cores, one generator: generator 0 on core 0, trainer on 1, a joined generator on the trainer's
    ({0, 1}, 1, {("generator", 0): [0], ("trainer", 0): [1], ("generator", 1): [1], ("generator", 3): [1]}),
    # 4 cores, 2 generators: one core each, joined ones on trainer rank 0's core 2
    ({0, 1, 2, 3}, 2, {("generator", 0): [0], ("generator", 1): [1], ("trainer", 0): [2], ("generator", 2): [2]}),
    # 2 cores, 2 generators: one engine per core (never both on core 0), the second beside the trainer
    ({0, 1}, 2, {("generator", 0): [0], ("generator", 1): [1], ("trainer", 0): [1], ("generator", 2): [1]}),
])
def test_joined_generators_are_placed_on_trainer_rank_0s_cores(monkeypatch, cores, generators, expected):
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: cores)
    cfg = _cfg(generators)
    assert {key: cpu_cores_for(*key, cfg) for key in expected} == expected
    assert [shares_trainer_cores(r, cfg, cpu_cores_for("generator", r, cfg)) for r in range(generators + 2)] == \
        [False] * generators + [True, True]


@pytest.mark.parametrize("cores, generators, trainer_ranks", [({0, 1}, 2, 1), ({0, 1, 2}, 3, 2), ({0, 1, 2, 3}, 3, 4)])
def test_short_of_cores_no_two_engines_share_a_core_while_there_are_cores_enough_for_them(
        monkeypatch, cores, generators, trainer_ranks):
    """A generator restarted beside another engine on one core got 2 s of CPU in 2.5 min (2 cores,
    2 generators, both on core 0): each generator has one core, distinct while cores suffice."""
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: cores)
    cfg = _cfg(generators, trainer_ranks)
    placed = [cpu_cores_for("generator", r, cfg) for r in range(generators)]
    assert all(len(c) == 1 for c in placed), placed
    assert len({c[0] for c in placed}) == min(generators, len(cores)), placed
    trainer = {c for r in range(trainer_ranks) for c in cpu_cores_for("trainer", r, cfg)}
    assert trainer and trainer <= cores, trainer


def test_nothing_shares_the_trainer_cores_without_a_core_plan(monkeypatch):
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: {0, 1})
    cfg = _cfg(plan="none")
    assert not shares_trainer_cores(1, cfg, cpu_cores_for("generator", 1, cfg))
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: {0})  # one core: nothing is pinned
    cfg = _cfg()
    assert not shares_trainer_cores(1, cfg, cpu_cores_for("generator", 1, cfg))


CHILD = r"""
import json, os, subprocess, sys
from pipeline.roles.common import lower_cpu_priority

def autogroup():
    try:
        return open("/proc/self/autogroup").read().split()[-1]
    except OSError:
        return None

lower_cpu_priority(int(sys.argv[1]))
REPORT = ("import os; print(os.nice(0)); print(open('/proc/self/autogroup').read().split()[-1] "
          "if os.path.exists('/proc/self/autogroup') else None)")
grandchild = subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True, check=True).stdout.split()
print(json.dumps({"nice": os.nice(0), "autogroup": autogroup(), "grandchild": grandchild}))
"""


def _lowered(nice: int) -> dict:
    """What a child in a session of its own reports after `lower_cpu_priority(nice)`."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(nice)], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_lowered_priority_covers_the_process_its_children_and_its_session_autogroup():
    """Run in a session of its own, as every local task is: the nice value alone would not order
    it against another session's processes where the kernel groups sessions (autogroups), so the
    autogroup's nice value is raised as well; an engine the process starts inherits both."""
    got = _lowered(7)
    base = os.nice(0)
    assert got["nice"] == min(19, base + 7) and got["grandchild"][0] == str(got["nice"]), got
    if got["autogroup"] is None:
        print("no /proc/self/autogroup on this kernel: only the nice value is checked")
    else:
        assert got["autogroup"] == "7" and got["grandchild"][1] == "7", got


def test_a_priority_of_zero_changes_nothing():
    got = _lowered(0)
    assert got["nice"] == os.nice(0), got
    assert got["autogroup"] in (None, "0"), got
