"""Synthetic generator and trainer processes: real sockets and files, no model.

They exercise the data plane at full speed in tests and benchmarks (``bench/ingest.py``): the
generator answers each work item with well-formed samples of configurable length and the
trainer pulls step batches and advances the policy version. Where a real engine stands, these
stand in for it only because the test measures the orchestrator, not the engine.

Test and benchmark code, not part of the package. Run as
``python tests/support/loadgen.py generator RUN_DIR --id 0 ...`` or ``... trainer RUN_DIR ...``.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import numpy as np

from pipeline.protocol.links import EvalItem, GeneratorLink, TrainerLink, WorkItem
from pipeline.protocol.record import FINISH_REASONS, RecordSchema
from pipeline.protocol.record_schema import SCALAR_COLUMNS
from pipeline.protocol.sample_batch import SampleBatch


def synthetic_group(item: WorkItem, generator_id: int, schema: RecordSchema, min_len: int,
                    max_len: int, vocab: int = 1000) -> SampleBatch:
    """G samples for a work item; completion starts with the prompt's last token half the time."""
    n = item.n
    rng = np.random.default_rng([item.group_id, item.attempt])
    clen = rng.integers(min_len, max_len + 1, n).astype(np.int32)
    total = int(clen.sum())
    ids = rng.integers(0, vocab, total, dtype=np.int32)
    starts = np.concatenate(([0], np.cumsum(clen)[:-1]))
    hit = rng.random(n) < 0.5
    ids[starts[hit]] = item.prompt_ids[-1]
    now = time.time()
    cols = {
        "group_id": np.full(n, item.group_id), "sample_index": np.arange(n),
        "prompt_id": np.full(n, item.prompt_id), "attempt": np.full(n, item.attempt),
        "finish_reason": np.full(n, FINISH_REASONS.index("stop")), "reward": np.full(n, np.nan),
        "generator_id": np.full(n, generator_id), "t_start": np.full(n, now),
        "t_end": np.full(n, now), "prompt_len": np.full(n, len(item.prompt_ids)),
        "completion_len": clen,
    }
    cols = {k: np.asarray(v, dtype=SCALAR_COLUMNS[k]) for k, v in cols.items()}
    cols["prompt_ids"] = np.tile(np.asarray(item.prompt_ids, np.int32), n)
    for name, (dtype, trail) in schema.prompt_token_fields().items():
        cols[name] = np.zeros((n * len(item.prompt_ids), *trail), dtype=dtype)
    for name, (dtype, trail) in schema.token_fields().items():
        if name == "completion_ids":
            cols[name] = ids
        elif name == "logprobs":
            cols[name] = -rng.exponential(1.0, total).astype(np.float32)
        elif name == "versions":
            cols[name] = np.full(total, item.version, np.int32)
        else:
            cols[name] = np.zeros((total, *trail), dtype=dtype)
    return SampleBatch(cols, schema, validate=False)


def run_generator(run_dir: Path, generator_id: int, slots: int, min_len: int, max_len: int,
                  duration_s: float, schema: RecordSchema) -> dict:
    link = GeneratorLink(run_dir, generator_id, slots, schema, resend_after_s=2.0)
    link.send_want()
    sent = 0
    end = time.monotonic() + duration_s
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while time.monotonic() < end and not stopping:
        for item in link.poll(0.05):
            if isinstance(item, EvalItem):
                one = WorkItem(0, 0, 0, 1, item.prompt_ids, 0)
                link.send_eval_result(item.step, np.array([item.index]),
                                      synthetic_group(one, generator_id, schema, min_len, max_len))
                continue
            link.queue_result(item, synthetic_group(item, generator_id, schema, min_len, max_len))
            sent += 1
    link.close()
    return {"sent": sent, "unacked": len(link.unacked), "outcomes": link.outcomes}


def run_trainer(run_dir: Path, steps: int, dp_size: int, step_time_s: float, schema: RecordSchema,
                timeout_s: float, start_step: int = 0, resume: bool = False,
                eval_every: int = 0) -> dict:
    link = TrainerLink(run_dir, schema)
    version = start_step
    if resume:
        link.resume(start_step)
    link.report_version(version)
    record = []
    for step in range(start_step, steps):
        if eval_every and step % eval_every == 0:
            link.request_eval(step, version)
        shares = [link.get_batch(step, version, dp_size, timeout_s, dp_rank=r) for r in range(dp_size)]
        batch = SampleBatch.concat([b for b, _ in shares])
        assert all((ranks == r).all() for r, (_, ranks) in enumerate(shares))
        record.append({"step": step, "n": len(batch), "min_version": int(batch.min_versions().min()),
                       "max_version": int(batch.columns["versions"].max()),
                       "rank_sizes": [len(b) for b, _ in shares]})
        time.sleep(step_time_s)
        version = step + 1  # the new weights are "loaded by every generator" at once here
        link.report_version(version)
    link.close()
    return {"steps": record}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/support/loadgen.py")
    p.add_argument("role", choices=["generator", "trainer"])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--id", type=int, default=0)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--start-step", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="tell the orchestrator the trainer restarted")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--schema", default="{}", help="RecordSchema as JSON")
    a = p.parse_args(argv)
    schema = RecordSchema.from_dict(json.loads(a.schema))
    if a.role == "generator":
        out = run_generator(a.run_dir, a.id, a.slots, a.min_len, a.max_len, a.duration, schema)
    else:
        out = run_trainer(a.run_dir, a.steps, a.dp_size, a.step_time, schema, a.timeout, a.start_step,
                          a.resume, a.eval_every)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
