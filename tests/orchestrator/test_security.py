"""The orchestrator fuzzer (docs/security.md): signed mutations of every message kind, replays,
forged stamps and roles, wrong MACs and random bytes against a live orchestrator process, which
must stay up with bounded memory and store nothing invalid. It prints its figures as one JSON line.
The run's bounds on values a synthetic run cannot carry (experts, sampling masks) are checked
directly (`pipeline/orchestrator/bounds.py`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.metrics import read_metrics
from pipeline.orchestrator.bounds import RunBounds
from pipeline.orchestrator.clock import PolicyClock
from pipeline.protocol.links import WorkItem, read_rendezvous
from pipeline.protocol.messages import KINDS
from pipeline.protocol.record import RecordError, RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.protocol.transport import load_or_create_secret
from pipeline.rollout_log.reader import RolloutLog
from support.fuzz import Fuzzer
from support.loadgen import synthetic_group
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
    key = load_or_create_secret(run_dir)
    fuzzer = Fuzzer(key, read_rendezvous(run_dir, 5)["address"])
    fuzzer.join()  # work leased to the fuzzer: honest groups beside the spoiled ones
    gen = start_generator(run_dir, 0)
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
    stored_by_fuzzer = 0
    with RolloutLog.open(run_dir / "rollouts") as log:
        for batch in log.iter_batches():  # nothing impossible was stored
            c = batch.columns
            stored_by_fuzzer += int((c["generator_id"] == 7).sum())
            assert c["completion_ids"].max() < 1000 and c["versions"].max() <= 5
            assert np.isfinite(c["t_start"]).all() and (c["t_start"] <= c["t_end"]).all()
    last = list(read_metrics(run_dir, "orchestrator"))[-1]
    figures = {"tried_per_kind": dict(sorted(fuzzer.tried.items())), "ways": dict(fuzzer.ways),
               "multi_group_results_spoiled": dict(sorted(fuzzer.spoiled.items())),
               "rejected": {k: v for k, v in last.items()
                            if k.startswith("frames_dropped_") or k in (
                                "count_bad_message", "count_invalid_result", "count_invalid_eval_result",
                                "count_handler_error", "count_result_messages", "count_result_groups",
                                "count_unleased")},
               "samples_stored_from_the_fuzzer": stored_by_fuzzer, "orchestrator_restarts": 0,
               "rss_start_mib": round(start_rss, 1), "rss_peak_mib": round(peak, 1)}
    print(json.dumps(figures))
    assert set(fuzzer.tried) == set(KINDS) and sum(fuzzer.tried.values()) == messages
    assert len(fuzzer.spoiled) == 7, figures  # every way of spoiling a multi-group result was tried
    assert last["count_invalid_result"] > 0 and stored_by_fuzzer > 0, figures  # refused alone, the rest stored
    assert last.get("count_handler_error", 0) == 0, figures  # every bad value caught by a check
    assert peak - start_rss < 256, figures  # bounded: no queue grows with the messages sent
    return figures


def test_signed_fuzzing_never_stops_the_orchestrator_nor_reaches_the_log(tmp_path):
    """5,000 signed mutations of every kind (multi-group results with a group spoiled among them),
    replays, forged stamps and roles, wrong MACs and random bytes against a live orchestrator; then a trainer runs 4 steps (~10 s)."""
    fuzz_live_orchestrator(tmp_path, 5_000)


@pytest.mark.slow
def test_fifty_thousand_fuzzed_messages(tmp_path):
    """The same with 50,000 messages (~2 min)."""
    fuzz_live_orchestrator(tmp_path, 50_000)


def test_run_bounds_refuse_expert_and_sampling_mask_ids_the_model_cannot_have():
    schema = RecordSchema(routed_experts=(2, 4), sampling_mask_k=4)
    item = WorkItem(0, 0, 0, 2, np.arange(5, dtype=np.int32), 3)
    group = synthetic_group(item, 0, schema, 4, 6)
    clock = PolicyClock(max_staleness=1, trainer_step=2)
    RunBounds(1000, 8).check(group, clock)  # versions 3 = step 2 + 1: the newest weights
    never_fed = {k: np.array(v) for k, v in group.columns.items()}
    never_fed["routed_experts"][-1] = -1  # the last completion token's row: never fed, all -1 (record)
    RunBounds(1000, 8).check(SampleBatch(never_fed, schema, validate=False), clock)
    for name, value, problem in [("routed_experts", 8, "expert ids 0..8, the model has 8"),
                                 ("prompt_routed_experts", -2, "expert ids -2..0"),
                                 ("sampling_mask", 1000, "token id 1000"),
                                 ("sampling_mask", -2, "below -1"),
                                 ("versions", 4, "newer than any weights"),
                                 ("t_end", np.nan, "NaN")]:
        cols = {k: np.array(v) for k, v in group.columns.items()}
        cols[name].reshape(-1)[-1] = value
        with pytest.raises(RecordError, match=problem):
            RunBounds(1000, 8).check(SampleBatch(cols, schema, validate=False), clock)
    with pytest.raises(RecordError, match="the model has no experts"):
        RunBounds(1000).check(group, clock)
    nan_logprob = {k: np.array(v) for k, v in group.columns.items()}
    nan_logprob["logprobs"][-1] = np.nan  # not re-checked by the bounds: the record refuses it first
    with pytest.raises(RecordError, match="logprobs holds NaN"):
        SampleBatch(nan_logprob, schema)
