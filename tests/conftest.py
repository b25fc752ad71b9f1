"""Shared pytest set-up: resource markers skip with a printed reason when the resource is absent;
every test fails if a process it started outlives it (`no_process_left_behind`), and a Slurm test
starts on an idle cluster and fails if it leaves a job queued or a node out of service
(`slurm_cluster_left_clean`), which is then cancelled or resumed so that the next tests' jobs do
not wait behind it.

Layout: ``tests/<package>/test_*.py`` mirrors ``pipeline/<package>/``; shared helpers live in
``tests/support/``. Test modules are imported by their basename (pytest's default import mode, no
``__init__.py``), so basenames are unique across ``tests/`` (`tests/test_architecture.py` checks
it), and every test directory is on the path: a test that reuses another's helpers (a run's
config, a launcher) imports it by name whichever directories the run collects."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest

for _tests_of in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir() and p.name.isidentifier()
                        and p.name not in ("support", "__pycache__")):
    if str(_tests_of) not in sys.path:
        sys.path.append(str(_tests_of))


def _cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    return None


def _slurm_reason() -> str | None:
    if shutil.which("sinfo") is None:
        return "Slurm client tools (sinfo) are not installed; run slurm/cluster/start.sh"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: slurmctld is not answering"
    if out.returncode != 0:
        return f"no reachable Slurm cluster (sinfo: {out.stderr.strip()[:200]})"
    if not any(s.strip().startswith("idle") or s.strip().startswith("mix") or s.strip().startswith("alloc")
               for s in out.stdout.splitlines()):
        return f"Slurm answers but no node is usable (states: {out.stdout.split()})"
    return None


def _slow_reason(config) -> str | None:
    if os.environ.get("TOKENFLOW_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return None
    return "a long run (minutes on 2 cores), not part of the default suite: TOKENFLOW_SLOW=1 or `-m slow` runs it"


def pytest_collection_modifyitems(config, items):
    reasons = {}
    slow = _slow_reason(config)
    for item in items:
        if slow and item.get_closest_marker("slow"):  # markers, not keywords: a directory named gpu is no marker
            item.add_marker(pytest.mark.skip(reason=f"[slow] {slow}"))
        for marker, probe in (("gpu", _cuda_reason), ("slurm", _slurm_reason)):
            if item.get_closest_marker(marker):
                if marker not in reasons:
                    reasons[marker] = probe()
                if reasons[marker]:
                    item.add_marker(pytest.mark.skip(reason=f"[{marker}] {reasons[marker]}"))


def pytest_report_header(config):
    lines = []
    for marker, probe in (("gpu", _cuda_reason), ("slurm", _slurm_reason)):
        r = probe()
        lines.append(f"{marker} tests: " + ("enabled" if r is None else f"SKIPPED ({r})"))
    return lines


@pytest.fixture(autouse=True)
def no_process_left_behind(monkeypatch):
    """Fail the test if any process it started (marked through the environment every child
    inherits, Slurm jobs included) is still alive 20 s after it; such processes are killed.
    Processes of other tests and other users of the machine carry other markers, or none."""
    from pipeline.supervise import MARKER_ENV
    from support.leftovers import leftovers

    marker = uuid.uuid4().hex
    monkeypatch.setenv(MARKER_ENV, marker)
    yield
    left = leftovers(marker, wait_s=20.0)
    if left:
        pytest.fail("processes left behind (killed now): " +
                    "; ".join(f"{pid}: {cmd[:160]}" for pid, cmd in sorted(left.items())), pytrace=False)


@pytest.fixture(scope="module")
def loop():
    """One asyncio loop per test module (engine tests drive vLLM's AsyncLLM from it); at the end the
    tasks left on it (vLLM's output handlers of engines already shut down) are cancelled."""
    import asyncio

    lp = asyncio.new_event_loop()
    yield lp
    pending = asyncio.all_tasks(lp)
    for task in pending:
        task.cancel()
    lp.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    lp.close()


def _slurm(*args: str) -> str:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    return out.stdout


def _jobs_since(t0: float) -> dict[str, str]:
    """Jobs in the queue submitted at or after ``t0`` (one entry per job, het components folded):
    job id -> "state (reason) name"."""
    jobs = {}
    for line in _slurm("squeue", "-h", "-o", "%i|%V|%T|%R|%j").splitlines():
        job, submitted, state, reason, name = (line.split("|") + [""] * 5)[:5]
        try:
            when = time.mktime(time.strptime(submitted, "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            when = t0
        if when >= t0 - 1:
            jobs.setdefault(job.split("+")[0], f"{state} ({reason}) {name}")
    return jobs


def _nodes() -> dict[str, tuple[str, str]]:
    """node -> (state, reason), from sinfo (which prints a row per partition)."""
    rows = (line.split("|") + [""] * 3 for line in _slurm("sinfo", "-h", "-N", "-o", "%N|%T|%E").splitlines())
    return {node: (state, reason) for node, state, reason, *_ in rows}


def _cluster_busy() -> list[str]:
    """Why the Slurm test cluster could not start a job at once: jobs queued, nodes not idle (busy,
    completing, not responding: a trailing ``*``, drained, down). Empty when it could."""
    why = [f"job {line}" for line in _slurm("squeue", "-h", "-o", "%i %T %R").splitlines()]
    return why + [f"node {node} {state}" for node, (state, _) in sorted(_nodes().items()) if state != "idle"]


@pytest.fixture(autouse=True)
def slurm_cluster_left_clean(request):
    """Around a `slurm` test. Before it: the cluster is idle (no job queued, every node idle and
    responding), waited for up to 180 s, so that the test's own time limits count its run only
    (a wait, if any, is a warning). After it: its jobs (submitted while it ran) leave the queue
    within 30 s, and no node is drained or down. Otherwise the test fails naming them, the jobs are
    cancelled and the nodes resumed (a job left queued would hold every later test's job pending)."""
    if "slurm" not in request.keywords:
        yield
        return
    start, first = time.monotonic(), _cluster_busy()
    busy = first
    while busy and time.monotonic() - start < 180:
        time.sleep(2)
        busy = _cluster_busy()
    if busy:
        pytest.fail(f"the Slurm test cluster is not idle after 180 s: {'; '.join(busy)}", pytrace=False)
    if first:  # in the run's warnings summary, which CI's output keeps
        warnings.warn(f"waited {time.monotonic() - start:.0f} s for the Slurm test cluster to be idle: "
                      f"{'; '.join(first)}")
    t0 = time.time()
    yield
    deadline = time.monotonic() + 30
    while (left := _jobs_since(t0)) and time.monotonic() < deadline:
        time.sleep(1)
    problems = [f"job {job} still queued: {what}" for job, what in sorted(left.items())]
    if left:
        subprocess.run(["scancel", *left], capture_output=True, timeout=30)
        deadline = time.monotonic() + 60
        while _jobs_since(t0) and time.monotonic() < deadline:
            time.sleep(1)
    for node, (state, reason) in _nodes().items():
        if any(bad in state for bad in ("drain", "down", "fail")):
            problems.append(f"node {node} {state}: {reason}")
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True,
                           timeout=30)
    if problems:
        pytest.fail("the Slurm test cluster was left busy (cancelled/resumed now): " + "; ".join(sorted(problems)),
                    pytrace=False)
