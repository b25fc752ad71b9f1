"""Following a run's metrics files while they grow (pipeline.observe.follow): each complete line
once, a partial line when it ends, a file that appears later (a restarted role) from its start,
each poll's records in time order. The files are written here by hand (the layout is the contract)."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.observe.follow import MetricsFollower


def append(path: Path, text: str) -> None:
    path.parent.mkdir(exist_ok=True)
    with open(path, "a") as f:
        f.write(text)


def line(t: float, role: str, n: int, kind: str = "orchestrator") -> str:
    return json.dumps({"t": t, "role": role, "kind": kind, "n": n}) + "\n"


def test_the_follower_reads_new_lines_and_files_that_appear_later(tmp_path):
    first, restarted = tmp_path / "metrics" / "orchestrator-n1-7.jsonl", tmp_path / "metrics" / "orchestrator-n2-9.jsonl"
    follow = MetricsFollower(tmp_path)
    assert follow.poll() == []  # no file yet
    append(first, line(1.0, "orchestrator", 0) + line(2.0, "orchestrator", 1) + '{"t": 3.0, "ro')
    assert [r["n"] for r in follow.poll()] == [0, 1]  # the partial line waits
    append(first, 'le": "orchestrator", "kind": "orchestrator", "n": 2}\n')
    append(tmp_path / "metrics" / "trainer-n1-5.jsonl", line(2.5, "trainer", 10, kind="train_step"))
    append(restarted, line(2.8, "orchestrator", 20) + line(4.0, "orchestrator", 21))
    assert [r["n"] for r in follow.poll()] == [10, 20, 2, 21]  # merged by time
    assert follow.poll() == []
    assert follow.last("orchestrator")["n"] == 21 and follow.last("train_step")["n"] == 10
