"""Packed (THD) against padded batches: the attention alone against a plain softmax per sequence,
the layout's bookkeeping, and the whole trainer on a tiny MoE with Keep Routing and Keep Sampling
Mask on, several micro-batches, both layouts (per-token logprobs, gradients, a checkpoint saved
packed and trained padded; the packed run with selective recomputation).

Trainer ranks run this file as a script (megatron's parallel state is process-global). Both layouts
run ``VarlenAttention`` (the padded rows as sequences of known length), so the trainer comparison
checks the layouts' bookkeeping (placement, positions, padding, masks, routing rows); the attention
itself is checked against an independent plain softmax in the first test.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_routing_replay import random_routing  # noqa: E402
from test_trainer import launch  # noqa: E402

TOL = 1e-6  # fp32: max |packed - padded| of a per-token logprob, a gradient element and a weight after a step
# (measured: logprobs 0, gradients 2.4e-8; with megatron's local attention on the padded path the
# logprobs differed by 2.6e-6)
# Adam normalises each element's step, so a gradient element at rounding level moves by ~lr either
# way; adam_eps = 1e-3 keeps steps linear in such elements (their weight error ~ lr x grad error / eps)
SEED, N, BUDGET = 5, 8, 64


def naive_attention(q, k, v, scale):
    """One sequence: [s, heads, d] queries, [s, groups, d] keys/values, causal softmax."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_varlen_attention_equals_plain_softmax_per_sequence_and_holds_no_square_tensor():
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipeline.trainer.attention import varlen_causal_attention

    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3]
    t = sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    q = torch.randn(t, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)

    class Shapes(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(x, torch.Tensor):
                    self.seen.append(tuple(x.shape))
            return out

    with Shapes() as mode:
        out = varlen_causal_attention(q.float(), k.float(), v.float(), cu, max(lengths), 8 ** -0.5)
        out.sum().backward()
    squares = [s for s in mode.seen if sum(d >= 9 for d in s) >= 2]
    assert not squares, f"tensors with two sequence-length dimensions: {squares}"
    ref = torch.cat([naive_attention(q[a:b], k[a:b], v[a:b], 8 ** -0.5)
                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    assert torch.allclose(out.double(), ref, atol=1e-5)
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    ref.sum().backward()
    assert all(torch.allclose(a, x.grad, atol=1e-5) for a, x in zip(got, (q, k, v)))


def test_padded_rows_run_the_packed_attention_calls_and_never_attend_padding():
    from megatron.core.transformer import TransformerConfig

    from pipeline.trainer.attention import VarlenAttention, varlen_causal_attention
    from pipeline.trainer.layout import PaddedLayout
    from support.oracle import make_samples

    attention = VarlenAttention(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                                  num_query_groups=2, attention_dropout=0.0), 1, None, "self")
    mb = PaddedLayout(micro_batch_tokens=64).micro_batches(make_samples(SEED, 3, 50))[0]
    lengths = mb.real_lengths
    s, g = mb.input_ids.shape[1], torch.Generator().manual_seed(1)
    q = torch.randn(s, len(lengths), 4, 8, generator=g)
    k, v = (torch.randn(s, len(lengths), 2, 8, generator=g) for _ in range(2))
    for i, n in enumerate(lengths):  # padding: never read
        k[n:, i], v[n:, i] = float("nan"), float("nan")
    out = attention(q, k, v, None, packed_seq_params=mb.packed_seq_params)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    packed = varlen_causal_attention(*(torch.cat([x[:n, i] for i, n in enumerate(lengths)]) for x in (q, k, v)),
                                     cu, max(lengths), 8 ** -0.5).reshape(cu[-1], -1)
    assert min(lengths) < s and torch.equal(torch.cat([out[:n, i] for i, n in enumerate(lengths)]), packed)
    assert all(not out[n:, i].any() for i, n in enumerate(lengths))


def test_packed_layout_places_every_token_once_within_the_budget():
    from pipeline.trainer.layout import PackedLayout
    from support.oracle import make_samples

    samples = make_samples(SEED, 12, 50)
    layout = PackedLayout(micro_batch_tokens=40, pad_multiple=4)
    mbs = layout.micro_batches(samples)
    assert sorted(i for mb in mbs for i in mb.sample_index) == list(range(12))
    per_token = [np.arange(len(s.completion_ids), dtype=np.float32) + 100 * i for i, s in enumerate(samples)]
    for mb in mbs:
        width = mb.input_ids.shape[1]
        cu = mb.packed_seq_params.cu_seqlens_q.tolist()
        assert width % 4 == 0 and cu[-1] == width and (width <= 40 or len(mb.sample_index) == 1)
        assert mb.real_lengths == [sum(len(samples[i].prompt_ids) + len(samples[i].completion_ids) - 1
                                       for i in mb.sample_index)]
        for i, off in zip(mb.sample_index, mb.offsets):
            s = samples[i]
            tokens = np.concatenate([s.prompt_ids, s.completion_ids])
            assert mb.input_ids[0, off:off + len(tokens) - 1].tolist() == tokens[:-1].tolist()
            assert mb.labels[0, off:off + len(tokens) - 1].tolist() == tokens[1:].tolist()
            assert mb.position_ids[0, off] == 0 and off in cu
        back = layout.gather(mb, layout.scatter(mb, per_token))
        assert all(np.array_equal(b, per_token[i]) for b, i in zip(back, mb.sample_index))
        comp = layout.completions(mb, layout.scatter(mb, per_token))
        assert all(np.array_equal(comp[j, :len(per_token[i])].numpy(), per_token[i])
                   for j, i in enumerate(mb.sample_index))
        assert float(mb.loss_mask.sum()) == sum(len(samples[i].completion_ids) for i in mb.sample_index)
    dummy = layout.dummy()
    assert dummy.sample_index == [-1] and float(dummy.loss_mask.sum()) == 0 and dummy.input_ids.shape[1] == 4


def test_layout_and_recompute_settings_are_checked_and_every_layout_gets_the_attention_patch():
    from types import SimpleNamespace

    from megatron_patches import select_patches
    from pipeline.trainer.config import ParallelConfig
    from pipeline.trainer.layout import make_layout
    from pipeline.trainer.model import transformer_config

    with pytest.raises(ValueError, match="trainer.layout must be one of"):
        make_layout("thd", 64)
    with pytest.raises(ValueError, match="trainer.recompute must be one of"):
        transformer_config(SimpleNamespace(), ParallelConfig(), recompute="some")
    assert select_patches("cuda", False) == ["moe_te_general_gemm", "varlen_attention"]
    assert "varlen_attention" in select_patches("cpu", False)


# ----------------------------------------------------------------------------- rank scenario
def _samples(hf):
    from support.oracle import make_samples

    samples = random_routing(make_samples(SEED, N, hf.vocab_size), hf.num_hidden_layers, hf.num_experts,
                             hf.num_experts_per_tok, SEED)
    rng = np.random.default_rng(SEED)
    for s in samples:  # kept sets holding the sampled token and up to 5 others
        mask = np.full((len(s.completion_ids), 6), -1, np.int64)
        for t, tok in enumerate(s.completion_ids):
            others = rng.choice(hf.vocab_size, int(rng.integers(0, 6)), replace=False)
            ids = [int(tok)] + [int(o) for o in others if o != tok]
            mask[t, :len(ids)] = ids
        s.sampling_mask = mask
    return samples


def scenario(outdir: Path, args: dict) -> None:
    from safetensors.torch import save_file

    from pipeline.trainer.config import TrainerConfig
    from pipeline.trainer.engine import Trainer
    from pipeline.trainer.model import iter_hf_weights

    torch.set_num_threads(1)
    trainer = Trainer(TrainerConfig(model_dir=args["model_dir"], layout=args["layout"], routing_replay=True,
                                    recompute=args["recompute"],
                                    micro_batch_tokens=BUDGET, no_grad_micro_batch_tokens=BUDGET, lr=1e-3, adam_eps=1e-3,
                                    grad_clip=0.0, logprob_chunk_tokens=7))
    samples = _samples(trainer.hf_config)
    micro_batches = len(trainer.layout.micro_batches(samples))
    logprobs = trainer.logprobs(samples)
    for s, lp in zip(samples, logprobs):  # behaviour near the policy, so the clip is sometimes active
        s.behaviour_logprobs = (lp + 0.1 * np.sign(np.sin(np.arange(len(lp)) + s.group_id))).astype(np.float32)
    metrics = [trainer.train_step(samples)]
    grads = {k: v.contiguous() for k, v in iter_hf_weights(trainer.model, trainer.hf_config, grads=True)}
    trainer.save(outdir / "ckpt")
    metrics.append(trainer.train_step(samples))
    weights = {k: v.contiguous() for k, v in iter_hf_weights(trainer.model, trainer.hf_config)}
    if args.get("resume"):  # the other layout's checkpoint, one step under this layout
        trainer.load(Path(args["resume"]))
        metrics.append(trainer.train_step(samples))
        save_file({k: v.contiguous() for k, v in iter_hf_weights(trainer.model, trainer.hf_config)},
                  str(outdir / "resumed.safetensors"))
    save_file(grads, str(outdir / "grads.safetensors"))
    save_file(weights, str(outdir / "weights.safetensors"))
    np.savez(outdir / "logprobs.npz", *logprobs)
    (outdir / "result.json").write_text(json.dumps({"metrics": metrics, "micro_batches": micro_batches}))
    trainer.close()


@pytest.mark.engine
def test_packed_and_padded_trainers_agree_with_routing_replay_and_sampling_masks(tmp_path):
    from safetensors.torch import load_file

    from support.oracle import sharpened_checkpoint

    model_dir = sharpened_checkpoint("moe", tmp_path / "model")
    runs = {}
    # the packed run also recomputes core attention in backward (trainer.recompute=selective)
    for layout, resume, recompute in (("packed", None, "selective"), ("padded", tmp_path / "packed" / "ckpt", "none")):
        runs[layout] = tmp_path / layout
        launch("layouts", 1, runs[layout], {"model_dir": str(model_dir), "layout": layout, "recompute": recompute,
                                            "resume": str(resume) if resume else None}, script=Path(__file__))
    result = {k: json.loads((d / "result.json").read_text()) for k, d in runs.items()}
    lp = {k: list(np.load(d / "logprobs.npz").values()) for k, d in runs.items()}
    grads = {k: load_file(str(d / "grads.safetensors")) for k, d in runs.items()}
    weights = {k: load_file(str(d / "weights.safetensors")) for k, d in runs.items()}
    resumed = load_file(str(runs["padded"] / "resumed.safetensors"))
    lp_abs = max(float(np.abs(a - b).max()) for a, b in zip(lp["packed"], lp["padded"]))
    grad_err = max(float((grads["packed"][n] - grads["padded"][n]).abs().max()) for n in grads["packed"])
    grad_top = max(float(g.abs().max()) for g in grads["packed"].values())
    weight_err = max(float((weights["packed"][n] - weights["padded"][n]).abs().max()) for n in weights["packed"])
    resume_err = max(float((weights["packed"][n] - resumed[n]).abs().max()) for n in resumed)
    print(f"\npacked vs padded: micro-batches {result['packed']['micro_batches']} vs "
          f"{result['padded']['micro_batches']}; max |logprob diff| {lp_abs:.2e}, max |grad diff| "
          f"{grad_err:.2e} (max |grad| {grad_top:.2e}), weights after 2 steps {weight_err:.2e}, "
          f"packed checkpoint trained padded {resume_err:.2e}")
    assert min(r["micro_batches"] for r in result.values()) >= 2
    assert all(m["routing_differ_frac"] > 0 for r in result.values() for m in r["metrics"])  # replay ran
    assert lp_abs <= TOL and grad_err <= TOL and grad_top > 1e3 * TOL
    assert weight_err <= TOL and resume_err <= TOL


if __name__ == "__main__":
    {"layouts": scenario}[sys.argv[1]](Path(sys.argv[2]), json.loads(sys.argv[3]))
