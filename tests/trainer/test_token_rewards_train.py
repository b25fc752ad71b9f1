"""Per-token rewards through the trainer (`Trainer.train_step` on one gloo rank, megatron-core):
with ``trainer.loss.token_reward_coef`` the step's loss equals the one computed by a loop over
tokens from the samples' advantages and token rewards (first step: ratio 1, no correction, so
each token's loss is -A_t)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from support.oracle import make_samples, sharpened_checkpoint
from test_trainer import _trainer, launch

COEF = 0.3


def scenario_token_rewards(outdir: Path, args: dict) -> None:
    from dataclasses import replace

    trainer = _trainer(args)
    rng = np.random.default_rng(1)
    samples = [replace(s, advantage=float(rng.normal()),
                       token_rewards=np.where(rng.random(len(s.completion_ids)) < 0.3,
                                              rng.normal(size=len(s.completion_ids)), 0.0).astype(np.float32))
               for s in make_samples(args["seed"], 6, trainer.hf_config.vocab_size)]
    metrics = trainer.train_step(samples)
    (outdir / "result.json").write_text(json.dumps({
        "loss": metrics["loss"], "tokens": metrics["tokens"],
        "samples": [{"advantage": s.advantage, "token_rewards": s.token_rewards.tolist()} for s in samples]}))
    trainer.close()


def test_trainer_loss_with_token_rewards_matches_a_loop_over_tokens(tmp_path):
    model = sharpened_checkpoint("dense", tmp_path / "dense")
    launch("token_rewards", 1, tmp_path / "run", {"model_dir": str(model), "seed": 3,
                                                  "loss": {"correction": "none", "token_reward_coef": COEF}},
           script=Path(__file__))
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    total, count = 0.0, 0
    for s in result["samples"]:
        r = s["token_rewards"]
        for t in range(len(r)):
            later = 0.0
            for x in r[t:]:
                later += x
            total += -(s["advantage"] + COEF * later)
            count += 1
    assert result["tokens"] == count
    print(f"loss {result['loss']:.6f}, loop reference {total / count:.6f}")
    assert result["loss"] == pytest.approx(total / count, abs=1e-5)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    globals()[f"scenario_{sys.argv[1]}"](Path(sys.argv[2]), json.loads(sys.argv[3]))
