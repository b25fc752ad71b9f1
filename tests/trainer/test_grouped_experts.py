"""Grouped experts (pipeline.trainer.grouped_experts) against megatron's SequentialMLP, the loop
they replace: the same weights give the same outputs and gradients within 1e-6 relative (fp32:
max |grouped - loop| / max |loop|, per tensor), for the
experts module alone (uneven token counts, an expert with none) and for the whole model.

Runs in a fresh process (megatron's parallel state is process-global): ``launch`` of
tests/trainer/test_trainer.py starts this file as a script on one gloo rank.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

TOL = 1e-6


def rel(a, b) -> float:
    """max |a - b| / max |a| (a: the loop's value)."""
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


def scenario_grouped(outdir: Path, args: dict) -> None:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_patches import apply_patches
    from pipeline.trainer.config import ParallelConfig
    from pipeline.trainer.model import build_gpt_model, load_hf_config, load_hf_weights, spec_norm

    cuda = args.get("cuda", False)
    dtype = "bfloat16" if cuda else "float32"
    if cuda:
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    hf = load_hf_config(args["model_dir"])
    apply_patches("cpu", sequence_parallel=False, norm=spec_norm(hf))
    ps.initialize_model_parallel(1, expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    models = {}
    for grouped in (False, True):
        model = build_gpt_model(hf, ParallelConfig(grouped_experts=grouped, params_dtype=dtype))
        load_hf_weights(model, hf, args["model_dir"])
        models[grouped] = model
    result = {"classes": [type(models[g].decoder.layers[0].mlp.experts).__name__ for g in (False, True)],
              "grouped": all(layer.mlp.experts.groups() for layer in models[True].decoder.layers)}

    gen = torch.Generator().manual_seed(0)
    device, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    counts = torch.tensor([3, 0, 5, 1]) * (16 if cuda else 1)  # grouped_mm wants 16-row multiples
    x = torch.randn(int(counts.sum()), hf.hidden_size, generator=gen).to(device, dt)
    probs = torch.rand(len(x), generator=gen).to(device)
    w = torch.randn(len(x), hf.hidden_size, generator=gen).to(device, dt)
    counts = counts.to(device)
    alone = {}
    for grouped, model in models.items():
        experts = model.decoder.layers[0].mlp.experts
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out, _ = experts(xi, counts, pi)
        (out * w).sum().backward()
        alone[grouped] = [t.float() for t in [out.detach(), xi.grad, pi.grad, *(p.grad for p in experts.parameters())]]
        model.zero_grad()
    result["experts_max_diff"] = max(rel(a, b) for a, b in zip(alone[False], alone[True]))

    ids = torch.randint(3, hf.vocab_size, (2, 24), generator=gen).to(device)
    pos = torch.arange(24).expand(2, 24).to(device)
    logit_w = torch.randn(2, 24, hf.vocab_size, generator=gen).to(device, dt)
    whole = {}
    for grouped, model in models.items():
        logits = model(ids, pos, None)
        (logits * logit_w).sum().backward()
        whole[grouped] = (logits.detach().float(), {n: p.main_grad if getattr(p, "main_grad", None) is not None
                                                    else p.grad.float() for n, p in model.named_parameters()})
    result["logits_max_diff"] = rel(whole[False][0], whole[True][0])
    result["grad_max_diff"] = max(rel(g, whole[True][1][n]) for n, g in whole[False][1].items())
    result["grads_compared"] = len(whole[False][1])
    (outdir / "result.json").write_text(json.dumps(result))
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.mark.engine
def test_grouped_experts_equal_the_sequential_loop(tmp_path):
    """About 10 s (one megatron rank)."""
    from support.oracle import sharpened_checkpoint
    from test_trainer import launch

    model_dir = sharpened_checkpoint("moe", tmp_path / "moe")
    launch("grouped", 1, tmp_path / "out", {"model_dir": str(model_dir)}, script=Path(__file__))
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    print(result)
    assert result["classes"] == ["SequentialMLP", "GroupedExperts"] and result["grouped"]
    assert result["experts_max_diff"] <= TOL
    assert result["logits_max_diff"] <= TOL and result["grad_max_diff"] <= TOL
    assert result["grads_compared"] > 10


@pytest.mark.gpu
def test_grouped_mm_on_cuda_equals_the_loop_in_bf16(tmp_path):
    """The torch._grouped_mm path (bf16, CUDA): within bf16 rounding of the loop (1e-2 relative)."""
    from support.oracle import sharpened_checkpoint
    from test_trainer import launch

    model_dir = sharpened_checkpoint("moe", tmp_path / "moe")
    launch("grouped", 1, tmp_path / "out", {"model_dir": str(model_dir), "cuda": True}, script=Path(__file__))
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    print(result)
    assert result["classes"] == ["SequentialMLP", "GroupedExperts"]
    assert max(result["experts_max_diff"], result["logits_max_diff"], result["grad_max_diff"]) <= 1e-2


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    scenario, out, spec = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    globals()[f"scenario_{scenario}"](out, spec)
