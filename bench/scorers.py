"""Scoring throughput per scorer role: samples/s through the scorer pool and scorer processes
(real ZeroMQ, real processes) vs the same scorer called in this process on the same batches.

    python bench/scorers.py --quick            # < 1 minute on a 2-core CPU: reward model, process rewards
    python bench/scorers.py --teacher          # also the vLLM teacher (tiny dense model; + ~30 s start-up)

For each role: G groups of ``group_size`` samples (random prompts of 32 tokens, completions of
``--completion`` tokens, a step token every ~16 tokens) are submitted to a `RemoteScoring` pool
once its scorer process said hello; the clock runs from the first submit to the last completed
group. The in-process baseline runs the role's scorer on the same groups in batches of
``batch_groups`` groups. Printed per role: samples/s both ways and their ratio (the transport's
and batching's cost; 1.0 = free). The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _groups(n_groups: int, group_size: int, completion: int, vocab: int, step_token: int) -> list:
    from pipeline.protocol.record import RecordSchema
    from pipeline.protocol.sample_batch import SampleBatch

    rng = np.random.default_rng(0)
    out = []
    for g in range(n_groups):
        n, total = group_size, group_size * completion
        ids = rng.integers(1, vocab, total).astype(np.int32)
        ids[rng.random(total) < 1 / 16] = step_token
        cols = {"group_id": np.full(n, g, np.int64), "sample_index": np.arange(n, dtype=np.int32),
                "prompt_id": np.full(n, g, np.int64), "attempt": np.zeros(n, np.int32),
                "finish_reason": np.zeros(n, np.uint8), "reward": np.full(n, np.nan, np.float32),
                "generator_id": np.zeros(n, np.int32), "t_start": np.zeros(n), "t_end": np.zeros(n),
                "prompt_len": np.full(n, 32, np.int32), "completion_len": np.full(n, completion, np.int32),
                "prompt_ids": np.tile(rng.integers(1, vocab, 32).astype(np.int32), n),
                "completion_ids": ids, "logprobs": np.full(total, -1.0, np.float32),
                "versions": np.zeros(total, np.int32)}
        out.append(SampleBatch(cols, RecordSchema()))
    return out


def measure(role: str, scfg, groups: list, run: Path) -> dict:
    """Samples/s of one scorer process behind the pool, and of the scorer in this process."""
    from pipeline.config import RunConfig, TokenflowConfig, stored_record_schema
    from pipeline.orchestrator.prompts import PromptItem
    from pipeline.orchestrator.scoring import VerifierScorer
    from pipeline.run_dir import save_run_config
    from pipeline.scorers.pool import RemoteScoring
    from pipeline.scorers.role import build_scorer
    from pipeline.protocol.sample_batch import SampleBatch
    from pipeline.protocol.transport import TransportConfig

    run.mkdir(parents=True)
    cfg = TokenflowConfig(run=RunConfig(name="bench", dir=str(run)), scorers=scfg)
    save_run_config(run, cfg)
    service = "teacher" if scfg.teacher != "none" else "reward"
    verifier = VerifierScorer(lambda prompt, ids: 0.0) if scfg.reward == "verifier" else None
    pool = RemoteScoring(run, scfg, stored_record_schema(cfg), verifier, TransportConfig())
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.scorers.role", str(run), "--service", service],
                            stdout=open(run / "scorer.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not pool.peers:
            list(pool.completed())
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {role} scorer did not start: {(run / 'scorer.log').read_text()[-2000:]}")
            time.sleep(0.05)
        dummy = PromptItem(0, np.zeros(1, np.int32), None)
        t0 = time.perf_counter()
        for g in groups:
            pool.submit(int(g.columns["group_id"][0]), g, dummy)
        done, errors = 0, 0
        while done < len(groups):
            for _, _, _, err in pool.completed():
                done += 1
                errors += err is not None
            time.sleep(0.001)
        remote_s = time.perf_counter() - t0
    finally:
        pool.close()
        proc.wait(timeout=60)
    scorer = build_scorer(scfg, service, run, scfg.teacher_model)
    t0 = time.perf_counter()
    for i in range(0, len(groups), scfg.batch_groups):
        scorer(SampleBatch.concat(groups[i:i + scfg.batch_groups]))
    local_s = time.perf_counter() - t0
    n = sum(len(g) for g in groups)
    return {"samples": n, "errors": errors, "remote_samples_per_s": n / remote_s,
            "in_process_samples_per_s": n / local_s, "ratio": local_s / remote_s}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python bench/scorers.py")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small workload (< 1 minute)")
    size.add_argument("--smoke", action="store_true", help="2 groups of 16-token completions: the report's keys, not its figures")
    p.add_argument("--teacher", action="store_true", help="also the vLLM teacher (heavy)")
    p.add_argument("--completion", type=int, default=128)
    a = p.parse_args(argv)
    from pipeline.scorers.config import ScorersConfig
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' shared helpers
    from support.reward_model import build_tiny_reward_model

    n_groups = 2 if a.smoke else 16 if a.quick else 64
    if a.smoke:
        a.completion = 16
    work = Path(tempfile.mkdtemp(prefix="bench-scorers-"))
    rm = build_tiny_reward_model(work / "rm", vocab_size=1024, hidden_size=256)
    groups = _groups(n_groups, 8, a.completion, 1000, 7)
    roles = {"reward_model": ScorersConfig(reward="reward_model", reward_model=str(rm)),
             "process_reward": ScorersConfig(reward="process_reward", reward_model=str(rm), step_token_id=7)}
    if a.teacher:
        from pipeline.models.tiny import TinyModelSpec, ensure_tiny_model
        roles["teacher"] = ScorersConfig(teacher="frozen",
                                         teacher_model=str(ensure_tiny_model(spec=TinyModelSpec(vocab_size=1024))))
    results = {}
    for role, scfg in roles.items():
        r = measure(role, scfg, groups, work / role)
        results[role] = r
        print(f"{role:<15} pool + process {r['remote_samples_per_s']:8.1f} samples/s   in process "
              f"{r['in_process_samples_per_s']:8.1f} samples/s   ratio {r['ratio']:.2f}   errors {r['errors']}",
              flush=True)
    shutil.rmtree(work, ignore_errors=True)  # the reward model and the pools' run directories (kept on a failure)
    return {"benchmark": "scorers", "groups": n_groups, "group_size": 8, "completion_tokens": a.completion,
            "roles": results}


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    with no_process_left():
        print(json.dumps(main()))
