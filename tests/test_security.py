"""Trust nothing on a shared node (docs/security.md): a live orchestrator under signed fuzzing and
poisoned results, and another user (``nobody``) against a real run's files and sockets."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.metrics import read_metrics
from pipeline.protocol.links import GeneratorLink, TrainerLink, read_rendezvous
from pipeline.protocol.record import RecordSchema, SampleBatch
from pipeline.protocol.transport import load_or_create_secret
from pipeline.rollout_log.reader import RolloutLog
from support.fuzz import Fuzzer
from support.loadgen import synthetic_group
from test_orchestrator import check_log_invariants, run_trainer, start_generator, start_orchestrator, stop, \
    write_spec

POISONS = {
    "token id 2**31-1": lambda c: c["completion_ids"].__setitem__(0, 2**31 - 1),
    "version 10**6": lambda c: c["versions"].__setitem__(slice(None), 10**6),
    "NaN t_start": lambda c: c["t_start"].__setitem__(0, np.nan),
    "ends before it starts": lambda c: c["t_end"].__setitem__(0, c["t_start"][0] - 10),
}


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


def _poisoned(item, k: int) -> tuple[str | None, SampleBatch]:
    """Every fifth group honest (None), the others carry one impossible value."""
    group = synthetic_group(item, 9, RecordSchema(), 8, 16)
    if k % 5 == 0:
        return None, group
    name = list(POISONS)[k % len(POISONS)]
    cols = {key: np.array(v) for key, v in group.columns.items()}
    POISONS[name](cols)
    return name, SampleBatch(cols, RecordSchema(), validate=False)


def fuzz_live_orchestrator(run_dir: Path, messages: int) -> dict:
    write_spec(run_dir)
    orch = start_orchestrator(run_dir)
    gen = start_generator(run_dir, 0)
    key = load_or_create_secret(run_dir)
    fuzzer = Fuzzer(key, read_rendezvous(run_dir, 5)["address"])
    trainer = TrainerLink(run_dir, RecordSchema())
    trainer.report_version(0)  # admission opens: the poisoner below is granted work
    poisoner = GeneratorLink(run_dir, 9, 4, RecordSchema())
    poisoned: dict[tuple[int, int], str | None] = {}
    start_rss = _rss_mib(orch.pid)
    try:
        for i in range(messages):
            fuzzer.one()
            if i % 25 == 0:
                for item in poisoner.poll(0.0):
                    if hasattr(item, "group_id"):
                        name, batch = _poisoned(item, len(poisoned))
                        poisoned[(item.group_id, item.attempt)] = name
                        poisoner.send_result(item, batch)
        deadline = time.monotonic() + 20
        while poisoner.unacked and time.monotonic() < deadline:
            poisoner.poll(0.2, send_credit=False)
        trainer.close()
        assert orch.poll() is None, "the orchestrator died under fuzzing"
        steps = run_trainer(run_dir, steps=4)
        assert orch.poll() is None, "the orchestrator died under fuzzing"
        peak = _rss_mib(orch.pid, "VmHWM")
    finally:
        fuzzer.close()
        poisoner.close()
        stop(gen)
        stop(orch)
    assert len(steps) == 4
    assert not poisoner.unacked, "a poisoned result was never answered"
    outcomes = poisoner.outcomes
    n_poison = sum(1 for v in poisoned.values() if v is not None)
    assert n_poison >= 4 and outcomes.get("invalid", 0) == n_poison, (outcomes, poisoned)
    assert sum(outcomes.values()) - outcomes.get("invalid", 0) == len(poisoned) - n_poison
    check_log_invariants(run_dir, max_staleness=1)
    with RolloutLog.open(run_dir / "rollouts") as log:
        for batch in log.iter_batches():  # nothing impossible was stored
            c = batch.columns
            assert c["completion_ids"].max() < 1000 and c["versions"].max() <= 5
            assert np.isfinite(c["t_start"]).all() and (c["t_start"] <= c["t_end"]).all()
            assert not (c["generator_id"] == 9).any() or outcomes.get("invalid") == n_poison
    last = list(read_metrics(run_dir, "orchestrator"))[-1]
    figures = {"tried_per_kind": dict(sorted(fuzzer.tried.items())), "ways": dict(fuzzer.ways),
               "rejected": {k: v for k, v in last.items()
                            if k.startswith("frames_dropped_") or k in (
                                "count_bad_message", "count_invalid_result", "count_invalid_eval_result",
                                "count_handler_error")},
               "poisoned_results": n_poison, "orchestrator_restarts": 0,
               "rss_start_mib": round(start_rss, 1), "rss_peak_mib": round(peak, 1)}
    print(json.dumps(figures))
    assert set(fuzzer.tried) == set(__import__("pipeline.protocol.messages").protocol.messages.KINDS)
    assert peak - start_rss < 256, figures  # bounded: no queue grows with the messages sent
    return figures


def test_signed_fuzzing_and_poisoned_results_never_stop_the_orchestrator_nor_reach_the_log(tmp_path):
    """5,000 signed mutations of every kind, replays, forged stamps and roles, wrong MACs and random
    bytes against a live orchestrator, plus results carrying impossible values (~15 s)."""
    fuzz_live_orchestrator(tmp_path, 5_000)


@pytest.mark.slow
def test_fifty_thousand_fuzzed_messages(tmp_path):
    """The same with 50,000 messages (~2 min)."""
    fuzz_live_orchestrator(tmp_path, 50_000)
