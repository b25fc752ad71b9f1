"""The data-parallel split by cost against measured step times (one megatron rank on CPU/gloo).

    python bench/dp_balance.py --quick     # about 2 minutes on 2 cores
    python bench/dp_balance.py --smoke     # seconds: the code path, tiny lengths

1. Cost models against measured step times: a training step (`Trainer.train_step`, forward +
   backward + AdamW) on one sample of T tokens (one micro-batch), for T over a length grid
   (median of ``--reps`` rounds, interleaved over the lengths so load changes hit all of them). Printed side by side: measured time(T) / time(T0), the FLOPs model's
   cost(T) / cost(T0) (`StepCost.of_shape`) with its error, and the time the measured model
   predicts: `StepCost.fit` (fixed + k (per_sample + linear T + quadratic T^2) seconds,
   non-negative least squares) fitted to these grid times and to steps of four samples at the
   short lengths (which separate each sample's own share from the step's), with its errors.
2. Split: a long-tailed batch (log-normal lengths, sigma 1.2) over ``--dp`` ranks, split by tokens
   (``StepCost()``), by FLOPs and by the fitted cost; each rank's share is timed as a step of its
   own in this process (interleaved rounds over every share of every split), and the step time of the data-parallel group is the slowest rank's.
   Printed: each split's slowest rank and imbalance (max / mean), the ratios tokens / fitted and
   FLOPs / fitted (> 1: the fitted split is faster), and the fitted model's error on the ranks'
   times (samples and batches it was not fitted on).

The model: the tiny dense checkpoint (`pipeline.models.tiny`), fp32, the packed layout (the
default). The last line is one JSON object; measured figures: bench/results/2026-12-06-trainer.md.
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


def step_times(trainer, batches: list, reps: int) -> list[float]:
    """Median seconds of a train step on each of ``batches``: one untimed step each, then ``reps``
    rounds over all of them (interleaved, so a change in the machine's load hits every batch)."""
    for samples in batches:
        trainer.train_step(samples)
    times = [[] for _ in batches]
    for _ in range(reps):
        for k, samples in enumerate(batches):
            start = time.perf_counter()
            trainer.train_step(samples)
            times[k].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> dict:
    """The benchmark; its report."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    from pipeline.orchestrator.batching import StepCost, split_by_cost
    from pipeline.plan.shape import ModelShape

    if args.smoke:
        series, batch_n, median_len, longest, reps = [16, 32, 64], 8, 24, 64, 1
    elif args.quick:
        series, batch_n, median_len, longest, reps = [256, 512, 1024, 2048, 4096], 24, 512, 4096, args.reps
    else:
        series, batch_n, median_len, longest, reps = [256, 512, 1024, 2048, 3072, 4096, 6144], 48, 384, 6144, args.reps
    trainer = make_trainer(max(series[-1], longest) + 8)
    vocab = trainer.hf_config.vocab_size
    flops = StepCost.of_shape(ModelShape.from_config(trainer.hf_config.to_dict()))
    # steps of one sample at every length, and of four at the short ones (each sample's own share)
    shapes = [(t, 1) for t in series] + [(t, 4) for t in series if 4 * t <= series[-1]]
    seconds = step_times(trainer, [samples_of([t] * k, vocab) for t, k in shapes], reps)
    fitted, fixed = StepCost.fit([t for t, _ in shapes], seconds, [k for _, k in shapes])
    print(f"FLOPs model: linear {flops.linear:.3g} per token, quadratic {flops.quadratic:.3g} per token pair; "
          f"fitted: {fixed * 1e3:.1f} ms per step + {fitted.per_sample * 1e3:.1f} ms per sample + "
          f"{fitted.linear * 1e6:.3g} us per token + {fitted.quadratic * 1e9:.3g} ns per token pair")
    for (t, k), sec in zip(shapes, seconds):
        if k > 1:
            predicted = fixed + k * float(fitted.of([t])[0])
            print(f"{k} x {t} tokens: {sec:.3f} s, fitted {predicted:.3f} s ({predicted / sec - 1:+.0%})")
    grid = [(t, sec) for (t, k), sec in zip(shapes, seconds) if k == 1]
    t0, s0 = grid[0]
    model = []
    print(f"{'T':>6} {'time s':>8} {'measured':>9} {'FLOPs':>7} {'err':>6} {'fitted s':>9} {'err':>6}")
    for t, sec in grid:
        predicted = float(flops.of([t])[0] / flops.of([t0])[0])
        fit_s = fixed + float(fitted.of([t])[0])
        model.append({"tokens": t, "seconds": round(sec, 4), "measured_ratio": round(sec / s0, 3),
                      "cost_ratio": round(predicted, 3), "token_ratio": t / t0,
                      "flops_ratio_error": round(predicted / (sec / s0) - 1, 3),
                      "fitted_s": round(fit_s, 4), "fitted_error": round(fit_s / sec - 1, 3)})
        print(f"{t:>6} {sec:>8.3f} {sec / s0:>9.2f} {predicted:>7.2f} {predicted / (sec / s0) - 1:>+6.0%} "
              f"{fit_s:>9.3f} {fit_s / sec - 1:>+6.0%}")
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(median_len), 1.2, batch_n), 8, longest).astype(int)
    batch = samples_of(lengths, vocab, seed=2)
    splits, errors = {}, []
    models = (("tokens", StepCost()), ("flops", flops), ("fitted", fitted))
    shares = {name: [np.flatnonzero(ranks == r) for r in range(args.dp) if (ranks == r).any()]
              for name, ranks in ((name, split_by_cost(lengths, args.dp, c)) for name, c in models)}
    every = [share for name, _ in models for share in shares[name]]
    measured = iter(step_times(trainer, [[batch[i] for i in share] for share in every], reps))
    for name, _ in models:
        times = [next(measured) for _ in shares[name]]
        errors += [(fixed + float(fitted.of(lengths[share]).sum())) / x - 1 for share, x in zip(shares[name], times)]
        predicted = max(fixed + float(fitted.of(lengths[share]).sum()) for share in shares[name])
        splits[name] = {"rank_seconds": [round(x, 4) for x in times], "max_s": round(max(times), 4),
                        "imbalance": round(max(times) / statistics.mean(times), 3),
                        "fitted_max_s": round(predicted, 4)}
        print(f"split by {name:6s}: rank step times {', '.join(f'{x:.3f}' for x in times)} s; "
              f"slowest {max(times):.3f} s (fitted model: {predicted:.3f} s), max/mean {splits[name]['imbalance']:.2f}")
    ratio = splits["tokens"]["max_s"] / splits["fitted"]["max_s"]
    flops_ratio = splits["flops"]["max_s"] / splits["fitted"]["max_s"]
    worst = max(errors, key=abs)
    print(f"group step time, token split / fitted split: {ratio:.2f}; FLOPs split / fitted split: "
          f"{flops_ratio:.2f}; fitted model on the ranks' times: worst error {worst:+.0%}, mean |error| "
          f"{np.mean(np.abs(errors)):.0%}")
    trainer.close()
    return {"bench": "dp_balance", "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
                      "dp": args.dp, "lengths": lengths.tolist(), "cost_model": model,
                      "fitted_cost": {"fixed_s": fixed, "per_sample_s": fitted.per_sample,
                                      "per_token_s": fitted.linear, "per_token_pair_s": fitted.quadratic},
                      "splits": splits, "token_over_cost_step_time": round(ratio, 3),
                      "flops_over_cost_step_time": round(flops_ratio, 3),
                      "rank_time_error": {"worst": round(worst, 3), "mean_abs": round(float(np.mean(np.abs(errors))), 3)}}


if __name__ == "__main__":
    print(json.dumps(main()))
