"""A run's metrics files (pipeline.metrics): one file per writer process, read back as one stream in
time order. The layout (``RUN/metrics/*.jsonl``, a legacy ``RUN/metrics.jsonl``) is the contract, so
the merge is checked on files written here by hand; the writers run in their own processes, on the
two clients of the loopback network filesystem (`scripts/netfs.sh`) where one is mounted, and one
is killed with SIGKILL mid-stream as a role is when its node fails."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pipeline
from pipeline.metrics import MetricsWriter, read_metrics
from support.log_places import netfs_dir

#: A writer process: `role` logs `count` ``probe`` records (seq 0, 1, ...; count -1: until
#: ``<start>.stop`` exists or it is killed) once the start file exists, and creates
#: ``<start>.<role>.<life>`` after its 2nd; each record `pad` bytes and about 110 more (330 in
#: all: a trainer step's; 1 MB: a kill most likely lands inside a write), `gap_ms` apart. A writer
#: that never stops is paced (a trainer logs per step): sshfs queues writes without bound, and the
#: sftp server, whose input buffer is copied on each read, fell ~40 MB behind an unpaced one and
#: took minutes to drain it (seen on a fresh mount: every later write and lookup waited).
WRITER = """
import sys, time
from pathlib import Path
from pipeline.metrics import MetricsWriter
from pipeline.supervise import die_with_parent
die_with_parent()  # a writer never outlives the test
run, role, start, life, count, pad, gap_ms = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), *map(int, sys.argv[4:])
stop = Path(f"{start}.stop")
while not start.exists():
    time.sleep(0.005)
m = MetricsWriter(run, role)
seq = 0
while seq != count and not stop.exists():
    m.log("probe", life=life, seq=seq, loss=0.123456789, reward_mean=0.5, pad="x" * pad)
    seq += 1
    if seq == 2:
        Path(f"{start}.{role}.{life}").touch()
    time.sleep(gap_ms / 1000)
m.close()
"""


def writer(run: Path, role: str, life: int, count: int, start: Path, pad: int = 220, gap_ms: int = 0) -> subprocess.Popen:
    root = str(Path(pipeline.__file__).resolve().parents[1])
    args = [str(run), role, str(start), str(life), str(count), str(pad), str(gap_ms)]
    return subprocess.Popen([sys.executable, "-c", WRITER, *args],
                            env={**os.environ, "PYTHONPATH": root}, cwd=root)


def seqs(records, role: str, life: int) -> list[int]:
    return [r["seq"] for r in records if r["role"] == role and r["life"] == life]


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(lines))


def rec(t: float, role: str, n: int, kind: str = "probe") -> str:
    return json.dumps({"t": t, "role": role, "kind": kind, "n": n}) + "\n"


def test_the_files_are_merged_in_time_order_ties_in_each_files_order(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [rec(1.0, "old", 0), rec(5.0, "old", 1)])  # a run from before the layout
    write_lines(tmp_path / "metrics" / "orchestrator-n2-7.jsonl",
                [rec(2.0, "orchestrator", 0), rec(5.0, "orchestrator", 1), rec(5.0, "orchestrator", 2),
                 rec(7.0, "orchestrator", 3, kind="eval"), '{"t": 8.0, "role": "orchestr'])  # killed mid-line
    write_lines(tmp_path / "metrics" / "trainer-n1-41.jsonl",
                [rec(3.0, "trainer", 0), "not json\n", rec(5.0, "trainer", 1), rec(6.0, "trainer", 2)])
    got = [(r["t"], r["role"], r["n"]) for r in read_metrics(tmp_path)]
    assert got == [(1.0, "old", 0), (2.0, "orchestrator", 0), (3.0, "trainer", 0), (5.0, "old", 1),
                   (5.0, "orchestrator", 1), (5.0, "orchestrator", 2), (5.0, "trainer", 1),
                   (6.0, "trainer", 2), (7.0, "orchestrator", 3)]
    assert [r["n"] for r in read_metrics(tmp_path, "eval")] == [3]


def test_each_writer_owns_a_new_file_in_a_private_directory(tmp_path):
    first, again = MetricsWriter(tmp_path, "orchestrator"), MetricsWriter(tmp_path, "orchestrator")
    first.log("probe", seq=0)
    again.log("probe", seq=1)
    first.log("probe", seq=2, bad=float("nan"))
    first.close(), again.close()
    assert first.path != again.path and {first.path.parent, again.path.parent} == {tmp_path / "metrics"}
    assert stat.S_IMODE((tmp_path / "metrics").stat().st_mode) == 0o700
    assert [json.loads(line)["seq"] for line in first.path.read_text().splitlines()] == [0, 2]
    assert [json.loads(line)["seq"] for line in again.path.read_text().splitlines()] == [1]
    records = list(read_metrics(tmp_path, "probe"))
    assert sorted(r["seq"] for r in records) == [0, 1, 2] and [r["seq"] for r in records if r["seq"] != 1] == [0, 2]
    assert set(records[2]) == {"t", "role", "kind", "seq", "bad"} and records[2]["bad"] is None


@pytest.fixture
def netfs_run():
    """(the run directory through the first mount, the same through the second)."""
    with netfs_dir("metrics") as pair:
        yield pair


def test_writers_on_two_clients_of_a_network_filesystem_lose_no_record(netfs_run, tmp_path):
    n = 1000
    start = tmp_path / "start"
    procs = [writer(netfs_run[0], "generator0", 1, n, start), writer(netfs_run[1], "generator1", 1, n, start)]
    start.touch()
    try:
        assert [p.wait(120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill(), p.wait()
    for seen_from in netfs_run:
        records = list(read_metrics(seen_from, "probe"))
        assert seqs(records, "generator0", 1) == list(range(n)) and seqs(records, "generator1", 1) == list(range(n))
        assert len(records) == 2 * n


def wait_for_file(path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout_s} s"
        time.sleep(0.005)


@pytest.mark.parametrize("where", ["local", "netfs"])
def test_a_role_killed_mid_stream_then_restarted_keeps_every_record_of_its_new_life(where, tmp_path, request):
    """The orchestrator is killed mid-stream in 6 lives, while the trainer appends, then a 7th life
    writes to its end: on the network filesystem from the other client (restarted on another node)."""
    run, restarted_in = request.getfixturevalue("netfs_run") if where == "netfs" else (tmp_path / "run",) * 2
    run.mkdir(exist_ok=True)
    start, lives = tmp_path / "start", 6
    other = writer(run, "trainer", 1, -1, start, gap_ms=2)  # goes on writing through the kills
    started = [other]
    start.touch()
    try:
        for life in range(1, lives + 1):
            started.append(writer(run, "orchestrator", life, -1, start, pad=1 << 20))
            wait_for_file(Path(f"{start}.orchestrator.{life}"))
            started[-1].send_signal(signal.SIGKILL)
            started[-1].wait(30)
        started.append(writer(restarted_in, "orchestrator", lives + 1, 200, start))
        assert started[-1].wait(120) == 0
        Path(f"{start}.stop").touch()
        assert other.wait(120) == 0
    finally:
        for p in started:
            p.kill(), p.wait()
    records = list(read_metrics(run, "probe"))
    for life in range(1, lives + 1):
        killed = seqs(records, "orchestrator", life)
        assert len(killed) >= 2 and killed == list(range(len(killed))), life
    trainer = seqs(records, "trainer", 1)
    assert seqs(records, "orchestrator", lives + 1) == list(range(200)) and trainer == list(range(len(trainer)))
    last = [r for r in records if r["role"] == "orchestrator"][-1]
    assert (last["life"], last["seq"]) == (lives + 1, 199)
