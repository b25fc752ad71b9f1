"""Recorded expert routing against transformers' own (Keep Routing tests of the generator, the
trainer and whole runs).

Positions whose k-th and (k+1)-th router probabilities are within ``TIE`` (a near-tie either side
may break differently) are left out and counted."""
from __future__ import annotations

import numpy as np

TIE = 1e-5


def hf_routing(model_dir, sequences):
    """Per sequence ``[positions, layers, k]`` experts and a ``[positions, layers]`` near-tie flag."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o))
             for layer in model.model.layers]
    out = []
    with torch.no_grad():
        for ids in sequences:
            seen.clear()
            model(torch.tensor([ids]))
            experts = torch.stack([o[2] for o in seen], 1)  # [T, layers, k]
            k = experts.shape[-1]
            probs = torch.stack([torch.softmax(o[0].float(), -1) for o in seen], 1)
            top = probs.topk(k + 1, dim=-1).values
            out.append((experts.numpy(), (top[..., k - 1] - top[..., k] < TIE).numpy()))
    for h in hooks:
        h.remove()
    return out


def compare(model_dir, sequences, recorded):
    """(pairs compared, near-ties left out, pairs that differ) against transformers."""
    compared = ties = differ = 0
    for seq, got, (want, tie) in zip(sequences, recorded, hf_routing(model_dir, sequences)):
        assert got.shape == want.shape, (got.shape, want.shape)
        assert got.min() >= 0, "a position the request ran has no recorded routing"
        same = (np.sort(got, -1) == np.sort(want, -1)).all(-1)  # [positions, layers]
        compared += int((~tie).sum())
        ties += int(tie.sum())
        differ += int((~same & ~tie).sum())
    return compared, ties, differ
