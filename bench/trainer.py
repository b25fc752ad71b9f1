"""The trainer's step on one CPU rank: speed against transformers, packing, memory in length.

One process, one tiny dense Qwen3 (fp32, built locally), one megatron-core trainer (gloo, world 1):

1. tokens/s of a training step (``Trainer.train_step``: forward, chunked logprobs, loss, backward,
   AdamW) against a plain transformers forward + backward + AdamW of the same model and batch
   (equal-length samples, no padding on either side), measured alternately in one run;
2. a long-tailed length distribution (log-normal, clipped): the padded layout's padding waste
   ``1 - real / (rows x width)`` and tokens/s of the packed layout over the padded one (the same
   trainer, layout swapped; both use the same attention module, so the ratio is the packing's);
   the bound is ``1 / (1 - waste)``;
3. peak tensor bytes of one training step above the post-setup baseline (``TensorMemory``, a
   dispatch mode that sums live storages; optimizer state exists already) for one sequence of
   1000, 2000, 4000, 8000 tokens, with the growth per doubling, and whether any tensor with two
   dimensions equal to the sequence length (an S x S tensor) was created (the lengths are no
   model width, so only attention scores could have such a shape).

Targets (issue #32): growth <= 2.2 per doubling; packed/padded >= 0.8 x 1/(1 - waste);
trainer >= 0.8 of transformers.

    python bench/trainer.py --quick     # < 1 minute on a quiet 2-core CPU
    python bench/trainer.py --smoke     # seconds: the report's keys, not its figures
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_model(out: Path, longest: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.models.tiny import TinyModelSpec

    spec = TinyModelSpec(kind="dense", max_position_embeddings=max(1024, longest))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32).save_pretrained(str(out))
    return out


def samples_of(lengths, vocab, seed=0, prompt=16):
    """One sample per fed length (prompt + completion - 1 = length), prompt ``prompt`` tokens."""
    from pipeline.trainer.layout import TrainSample

    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        p = min(prompt, n)
        c = n + 1 - p
        out.append(TrainSample(rng.integers(3, vocab, p), rng.integers(3, vocab, c), np.full(c, -2.0, np.float32),
                               reward=float(i % 2), group_id=i // 4))
    return out


def fed(samples) -> int:
    return sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)


def hf_step(model, optimizer, samples):
    """transformers forward + backward + AdamW on ``samples`` (equal lengths: one batch)."""
    import torch

    ids = torch.from_numpy(np.stack([np.concatenate([s.prompt_ids, s.completion_ids]) for s in samples]))
    logits = model(ids[:, :-1]).logits
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    (-logp.mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> dict:
    """The benchmark; its report."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--smoke", action="store_true", help="short lengths, one repetition: the report's keys")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.launch.rendezvous import free_port
    from pipeline.observe.tensor_memory import TensorMemory
    from pipeline.trainer.config import TrainerConfig
    from pipeline.trainer.engine import Trainer
    from pipeline.trainer.layout import make_layout

    memory_lengths = [100, 200, 400, 800] if args.smoke else [1000, 2000, 4000, 8000]  # none a model width
    reps = 1 if args.smoke else (2 if args.quick else args.reps)
    batch, length = (2, 128) if args.smoke else (8, 512)
    tail = 8 if args.smoke else (32 if args.quick else 64)
    report = {"bench": "trainer", "mode": "smoke" if args.smoke else "quick" if args.quick else "full"}
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        model_dir = build_model(Path(tmp) / "model", max(memory_lengths))
        budget = max(memory_lengths)
        trainer = Trainer(TrainerConfig(model_dir=str(model_dir), lr=1e-5, micro_batch_tokens=budget),
                          rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}")
        try:
            vocab = trainer.hf_config.vocab_size
            # 1. against transformers, same model and batch, alternating
            hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).train()
            hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)
            equal = samples_of([length] * batch, vocab)
            trainer.train_step(equal)
            hf_step(hf, hf_opt, equal)  # warm-up both (optimizer state, kernels)
            t_trainer, t_hf = [], []
            for _ in range(reps):
                t_trainer.append(timed(lambda: trainer.train_step(equal), 1))
                t_hf.append(timed(lambda: hf_step(hf, hf_opt, equal), 1))
            del hf, hf_opt
            tokens = fed(equal)
            report["throughput"] = {
                "batch": batch, "length": length, "trainer_tokens_per_s": tokens / float(np.median(t_trainer)),
                "transformers_tokens_per_s": tokens / float(np.median(t_hf))}
            report["throughput"]["ratio"] = (report["throughput"]["trainer_tokens_per_s"]
                                             / report["throughput"]["transformers_tokens_per_s"])
            # 2. packed against padded on a long-tailed distribution
            rng = np.random.default_rng(1)
            lengths = np.clip(rng.lognormal(np.log(length / 4), 0.8, tail), 16, 2 * length).astype(int).tolist()
            mixed = samples_of(lengths, vocab, seed=1)
            budget_mixed = 4 * length
            padded = make_layout("padded", budget_mixed)
            mbs = padded.micro_batches(mixed)
            waste = 1 - sum(sum(mb.real_lengths) for mb in mbs) / sum(mb.input_ids.numel() for mb in mbs)
            speed = {}
            for name in ("packed", "padded", "packed", "padded")[: 2 if args.smoke else 4]:
                trainer.layout = make_layout(name, budget_mixed)
                speed.setdefault(name, []).append(fed(mixed) / timed(lambda: trainer.train_step(mixed), 1))
            trainer.layout = make_layout("packed", budget)
            ratio = float(np.median(speed["packed"]) / np.median(speed["padded"]))
            report["packing"] = {"samples": len(mixed), "fed_tokens": fed(mixed), "padding_waste": waste,
                                 "packed_tokens_per_s": float(np.median(speed["packed"])),
                                 "padded_tokens_per_s": float(np.median(speed["padded"])),
                                 "packed_over_padded": ratio, "bound": 1 / (1 - waste)}
            # 3. peak bytes per length above the post-setup baseline, and no S x S tensor
            peaks, square = {}, []
            for n in memory_lengths:
                one = samples_of([n], vocab, seed=2)
                with TensorMemory() as mem:
                    trainer.train_step(one)
                peaks[n] = mem.peak_bytes
                square += [s for s in mem.shapes if sum(d == n for d in s) >= 2]
            growth = [peaks[b] / peaks[a] for a, b in zip(memory_lengths, memory_lengths[1:])]
            report["memory"] = {"peak_bytes": {str(k): v for k, v in peaks.items()},
                                "growth_per_doubling": growth, "square_tensors": sorted(set(square))}
        finally:
            trainer.close()
    report["targets"] = {
        "growth_per_doubling_max": 2.2, "packed_over_padded_min": 0.8 * report["packing"]["bound"],
        "trainer_over_transformers_min": 0.8}
    report["met"] = {
        "memory": max(report["memory"]["growth_per_doubling"]) <= 2.2 and not report["memory"]["square_tensors"],
        "packing": report["packing"]["packed_over_padded"] >= report["targets"]["packed_over_padded_min"],
        "throughput": report["throughput"]["ratio"] >= 0.8}
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
