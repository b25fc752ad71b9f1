"""Independent references for the trainer's oracle checks (tests and scripts/gpu_check.py).

- ``sharpened_checkpoint`` re-draws a tiny HF model's weights at unit scale (norm weights
  1 +- 0.2, matrices N(0, 1/fan_in)) from a fixed seed, so next-token distributions are far from
  uniform and a layout or conversion bug shows up in the logprobs (the 0.02-std init makes every
  tiny model nearly uniform: logprob ~ -log(vocab) whatever the weights).
- ``hf_logprobs`` computes per-completion-token logprobs with transformers, one unpadded sequence
  at a time, in float32 (TF32 off on CUDA) - nothing shared with the trainer's code path.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def sharpened_checkpoint(kind: str, out: Path, seed: int = 7, spec=None) -> Path:
    """``kind``: a tiny model name without "tiny-" ("dense", "moe", "moe8"; its tokenizer is copied
    along), or ``spec``: a ``TinyModelSpec`` whose config is used (no tokenizer; for trainer-only tests)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.models.tiny import resolve_model
    from pipeline.trainer.export import copy_tokenizer

    out = Path(out)
    if (out / "config.json").exists():
        return out
    source = None if spec is not None else resolve_model(f"tiny-{kind}")
    if spec is not None:
        model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    out.mkdir(parents=True, exist_ok=True)
    if source is not None:  # a complete Hugging Face directory: vLLM and run exports need the tokenizer
        copy_tokenizer(source, out)
    model.save_pretrained(str(out))  # config.json last: it marks the directory complete
    return out


def hf_logprobs(model_dir: Path, samples, device: str = "cpu") -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.completion_ids]))[None].to(device)
            logp = model(ids).logits[0].float().log_softmax(-1)
            p = len(s.prompt_ids)
            out.append(logp[p - 1:-1].gather(-1, ids[0, p:, None])[:, 0].cpu().numpy())
    return out


def make_samples(seed: int, n: int, vocab: int, min_len: int = 2, max_len: int = 20):
    """Deterministic samples in groups of 4 with 0/1 rewards; behaviour logprobs are zeros (fill
    them from a policy before training)."""
    from pipeline.trainer.layout import TrainSample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, c = int(rng.integers(3, 12)), int(rng.integers(min_len, max_len))
        out.append(TrainSample(rng.integers(3, vocab, p), rng.integers(3, vocab, c),
                               np.zeros(c), reward=float(rng.integers(0, 2)), group_id=i // 4))
    return out
