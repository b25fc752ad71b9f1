"""Measured memory of one trainer rank, for the planner's checks (tests/plan/test_planner_peaks.py).

Run as ``python tests/support/peak_probe.py peak OUTDIR JSON`` on every rank (``launch`` of
tests/trainer/test_trainer.py). Each rank builds a real `Trainer` (megatron-core on gloo) inside a
`TensorMemory`, runs one warm-up step (Adam's state appears on the first step), then a second
step, and writes ``rank{R}.json``:

- ``state_bytes``: live tensor bytes before the second step (parameters, gradient buffers,
  optimizer state, masters, reference model);
- ``peak_bytes``: the largest live total over the rank's life (the planner's ``peak``).

``trainer`` (optional) holds `TrainerConfig` fields to set (``layout``, ``logprob_chunk_tokens``,
``recompute``); the others are the trainer's defaults.

The batch: ``rows`` samples per data-parallel rank, each ``seq_len`` tokens (prompt 4), so every
micro-batch is exactly ``micro_batch_tokens`` padded tokens.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import numpy as np


def scenario_peak(outdir: Path, args: dict) -> None:
    import torch

    from pipeline.observe.tensor_memory import TensorMemory
    from pipeline.trainer.config import LossConfig, ParallelConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer
    from pipeline.trainer.layout import TrainSample

    with TensorMemory() as life:
        cfg = TrainerConfig(model_dir=args["model_dir"], parallel=ParallelConfig(**args.get("parallel", {})),
                            loss=LossConfig(kl_coef=args.get("kl_coef", 0.0)), lr=1e-4,
                            micro_batch_tokens=args["micro_batch_tokens"], **args.get("trainer", {}))
        trainer = Trainer(cfg)
        rng = np.random.default_rng(int(os.environ["RANK"]))
        vocab, n = trainer.hf_config.vocab_size, args["seq_len"] + 1
        samples = [TrainSample(rng.integers(3, vocab, 4), rng.integers(3, vocab, n - 4),
                               np.full(n - 4, -np.log(vocab)), reward=float(i % 2), group_id=i // 2)
                   for i in range(args["rows"])]
        trainer.train_step(samples)
        gc.collect()
        state = life.current_bytes
        trainer.train_step(samples)
        trainer.close()
    (outdir / f"rank{os.environ['RANK']}.json").write_text(
        json.dumps({"state_bytes": state, "peak_bytes": life.peak_bytes}))


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    scenario, out, spec = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    globals()[f"scenario_{scenario}"](out, spec)
