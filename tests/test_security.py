"""The orchestrator fuzzer (docs/security.md): signed mutations of every message kind, replays,
forged stamps and roles, wrong MACs and random bytes against a live orchestrator process, which
must stay up with bounded memory and store nothing invalid. It prints its figures as one JSON line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.metrics import read_metrics
from pipeline.protocol.links import read_rendezvous
from pipeline.protocol.messages import KINDS
from pipeline.protocol.transport import load_or_create_secret
from pipeline.rollout_log.reader import RolloutLog
from support.fuzz import Fuzzer
from test_orchestrator import check_log_invariants, run_trainer, start_generator, start_orchestrator, stop, \
    write_spec


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


def fuzz_live_orchestrator(run_dir: Path, messages: int) -> dict:
    write_spec(run_dir)
    orch = start_orchestrator(run_dir)
    gen = start_generator(run_dir, 0)
    key = load_or_create_secret(run_dir)
    fuzzer = Fuzzer(key, read_rendezvous(run_dir, 5)["address"])
    start_rss = _rss_mib(orch.pid)
    try:
        for i in range(messages):
            fuzzer.one()
        assert orch.poll() is None, "the orchestrator died under fuzzing"
        steps = run_trainer(run_dir, steps=4)
        assert orch.poll() is None, "the orchestrator died under fuzzing"
        peak = _rss_mib(orch.pid, "VmHWM")
    finally:
        fuzzer.close()
        stop(gen)
        stop(orch)
    assert len(steps) == 4
    check_log_invariants(run_dir, max_staleness=1)
    with RolloutLog.open(run_dir / "rollouts") as log:
        for batch in log.iter_batches():  # nothing impossible was stored
            c = batch.columns
            assert c["completion_ids"].max() < 1000 and c["versions"].max() <= 5
            assert np.isfinite(c["t_start"]).all() and (c["t_start"] <= c["t_end"]).all()
    last = list(read_metrics(run_dir, "orchestrator"))[-1]
    figures = {"tried_per_kind": dict(sorted(fuzzer.tried.items())), "ways": dict(fuzzer.ways),
               "rejected": {k: v for k, v in last.items()
                            if k.startswith("frames_dropped_") or k in (
                                "count_bad_message", "count_invalid_result", "count_invalid_eval_result",
                                "count_handler_error")},
               "orchestrator_restarts": 0,
               "rss_start_mib": round(start_rss, 1), "rss_peak_mib": round(peak, 1)}
    print(json.dumps(figures))
    assert set(fuzzer.tried) == set(KINDS) and sum(fuzzer.tried.values()) == messages
    assert last.get("count_handler_error", 0) == 0, figures  # every bad value caught by a check
    assert peak - start_rss < 256, figures  # bounded: no queue grows with the messages sent
    return figures


def test_signed_fuzzing_never_stops_the_orchestrator_nor_reaches_the_log(tmp_path):
    """5,000 signed mutations of every kind, replays, forged stamps and roles, wrong MACs and random
    bytes against a live orchestrator; then a trainer runs 4 steps (~10 s)."""
    fuzz_live_orchestrator(tmp_path, 5_000)


@pytest.mark.slow
def test_fifty_thousand_fuzzed_messages(tmp_path):
    """The same with 50,000 messages (~2 min)."""
    fuzz_live_orchestrator(tmp_path, 50_000)
