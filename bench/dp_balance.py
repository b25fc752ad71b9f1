"""The data-parallel split by cost against measured step times (one megatron rank on CPU/gloo).

    python bench/dp_balance.py --quick     # < 2 minutes on 2 cores
    python bench/dp_balance.py --smoke     # seconds: the code path, tiny lengths

1. Cost model: a training step (`Trainer.train_step`, forward + backward + AdamW) on one sample of
   T tokens, for T in a doubling series; printed side by side: measured time(T) / time(T0), the
   model's cost(T) / cost(T0) (`StepCost.of_shape`) and the token ratio T / T0.
2. Split: a long-tailed batch (log-normal lengths) over ``--dp`` ranks, split by tokens
   (``StepCost()``) and by cost; each rank's share is timed as a step of its own in this process,
   and the step time of the data-parallel group is the slowest rank's. Printed: both maxima, their
   ratio (tokens / cost: > 1 means the cost split is faster) and each split's imbalance (max / mean).

The model: the tiny dense checkpoint (`pipeline.models.tiny`), fp32, megatron's local attention.
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def make_trainer(micro_batch_tokens: int):
    import torch

    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.trainer.config import TrainerConfig
    from pipeline.trainer.engine import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from pipeline.launch.rendezvous import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    return Trainer(TrainerConfig(model_dir=str(ensure_tiny_model("dense")), lr=1e-5,
                                 micro_batch_tokens=micro_batch_tokens), rank=0, world_size=1)


def samples_of(lengths, vocab: int, seed: int = 0):
    from pipeline.trainer.layout import TrainSample

    rng = np.random.default_rng(seed)
    return [TrainSample(rng.integers(3, vocab, 4), rng.integers(3, vocab, int(t) - 3),
                        np.full(int(t) - 3, -np.log(vocab)), reward=float(i % 2), group_id=i // 2)
            for i, t in enumerate(lengths)]


def step_time(trainer, samples, reps: int) -> float:
    """Median seconds of ``reps`` train steps on ``samples`` (after one untimed step)."""
    trainer.train_step(samples)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        trainer.train_step(samples)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from pipeline.orchestrator.batching import StepCost, split_by_cost
    from pipeline.plan.shape import ModelShape

    if args.smoke:
        series, batch_n, median_len, longest, reps = [32, 64], 8, 24, 64, 1
    elif args.quick:
        series, batch_n, median_len, longest, reps = [128, 256, 512, 1024], 24, 192, 1024, args.reps
    else:
        series, batch_n, median_len, longest, reps = [128, 256, 512, 1024, 2048], 48, 128, 2048, args.reps
    trainer = make_trainer(max(series[-1], longest) + 8)
    vocab = trainer.hf_config.vocab_size
    cost = StepCost.of_shape(ModelShape.from_config(trainer.hf_config.to_dict()))
    print(f"cost model: linear {cost.linear:.3g} per token, quadratic {cost.quadratic:.3g} per token pair "
          f"(equal at T = {cost.linear / cost.quadratic:.0f})")
    rows = []
    for t in series:
        rows.append((t, step_time(trainer, samples_of([t], vocab), reps)))
    t0, s0 = rows[0]
    model = []
    print(f"{'T':>6} {'time s':>8} {'measured':>9} {'cost':>7} {'tokens':>7}")
    for t, s in rows:
        predicted = float(cost.of([t])[0] / cost.of([t0])[0])
        model.append({"tokens": t, "seconds": round(s, 4), "measured_ratio": round(s / s0, 3),
                      "cost_ratio": round(predicted, 3), "token_ratio": t / t0})
        print(f"{t:>6} {s:>8.3f} {s / s0:>9.2f} {predicted:>7.2f} {t / t0:>7.2f}")
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(median_len), 1.0, batch_n), 8, longest).astype(int)
    batch = samples_of(lengths, vocab, seed=2)
    splits = {}
    for name, c in (("tokens", StepCost()), ("cost", cost)):
        ranks = split_by_cost(lengths, args.dp, c)
        times = [step_time(trainer, [batch[i] for i in np.flatnonzero(ranks == r)], reps)
                 for r in range(args.dp) if (ranks == r).any()]
        splits[name] = {"rank_seconds": [round(x, 4) for x in times], "max_s": round(max(times), 4),
                        "imbalance": round(max(times) / statistics.mean(times), 3)}
        print(f"split by {name:6s}: rank step times {', '.join(f'{x:.3f}' for x in times)} s; "
              f"slowest {max(times):.3f} s, max/mean {splits[name]['imbalance']:.2f}")
    ratio = splits["tokens"]["max_s"] / splits["cost"]["max_s"]
    print(f"group step time, token split / cost split: {ratio:.2f}")
    trainer.close()
    print(json.dumps({"bench": "dp_balance", "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
                      "dp": args.dp, "lengths": lengths.tolist(), "cost_model": model, "splits": splits,
                      "token_over_cost_step_time": round(ratio, 3)}))


if __name__ == "__main__":
    main()
