"""LoRA (pipeline/trainer/lora.py): megatron-core with adapters against PEFT on transformers.

Each scenario runs in fresh rank processes (``tests/trainer/test_trainer.py``'s launcher). The trainer
draws non-trivial adapters (``init_adapters(b_std>0)``), computes logprobs, exports a PEFT
adapter directory, takes one step and exports again; the test loads each export with ``peft``
onto the base transformers model (an independent implementation: PEFT's own LoRA layers, and
for experts its ``target_parameters`` wrapper of transformers' fused expert tensors) and
compares per-token logprobs; a checkpoint after the step (adapters and their Adam state only)
must resume the next step exactly. The MoE scenario also checks that an expert's adapters receive a
gradient exactly when tokens are routed to that expert, and every scenario that the base weights
did not move and that the optimizer holds adapter state only. A multi-rank layout (dense TP2, MoE
EP2) must equal the one-rank run: the logprobs with the drawn adapters (the initialisation is
layout-independent), each adapter tensor's gradient of the step, and the logprobs after it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support.oracle import make_samples, sharpened_checkpoint  # noqa: E402
from test_trainer import launch, perturb_behaviour  # noqa: E402

PEFT_LOGPROB_TOL = 1e-4  # max |megatron - peft| per-token logprob, float32 (also: a layout vs one rank)
LAYOUT_GRAD_REL_TOL = 1e-4  # per adapter tensor: max |g_layout - g_one_rank| / max |g_one_rank|
LORA = {"rank": 4, "alpha": 8.0}


def _trainer(args):
    from pipeline.trainer.config import LoraConfig, ParallelConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer

    cfg = TrainerConfig(model_dir=args["model_dir"], parallel=ParallelConfig(**args.get("parallel", {})),
                        lora=LoraConfig(**args["lora"]), lr=1e-2, grad_clip=0.0, micro_batch_tokens=96)
    return Trainer(cfg)


def _routed_gradients(trainer):
    """One forward/backward on 3 tokens (4 under TP 2: sequence parallelism splits them evenly):
    ``{expert module: (tokens routed, adapter grad norm)}``."""
    import torch
    from megatron.core import parallel_state as ps

    from pipeline.trainer.model import unwrap

    gpt = unwrap(trainer.model)
    counts, handles = {}, []
    for name, mod in gpt.named_modules():
        if name.endswith("linear_fc1") and ".local_experts." in name:
            counts[name] = 0

            def count(mod, args, out, name=name):
                counts[name] += int(args[0].reshape(-1, args[0].shape[-1]).shape[0])
            handles.append(mod.register_forward_hook(count))
    trainer.model.zero_grad_buffer()
    n = 3 if ps.get_tensor_model_parallel_world_size() == 1 else 4
    ids = torch.tensor([[5, 17, 42, 99][:n]])
    logits = trainer.model(ids, torch.arange(n)[None], None)
    logits.float().log_softmax(-1)[0, :, 7].sum().backward()
    for h in handles:
        h.remove()
    out = {}
    for name, n in counts.items():
        expert = name.removesuffix(".linear_fc1")
        norms = [float(p.main_grad.norm()) for pn, p in gpt.named_parameters()
                 if pn.startswith(expert + ".") and pn.rpartition(".")[2] in ("lora_A", "lora_B")]
        out[name] = (n, norms)
    trainer.model.zero_grad_buffer()
    return out


def scenario_oracle(outdir: Path, args: dict) -> None:
    import torch
    from safetensors.torch import save_file

    from pipeline.trainer.lora import init_adapters
    from pipeline.trainer.model import iter_hf_weights, unwrap

    trainer = _trainer(args)
    gpt = unwrap(trainer.model)
    init_adapters(gpt, trainer.hf_config, seed=args["seed"], b_std=0.3)
    base_before = {n: p.detach().clone() for n, p in gpt.named_parameters() if not p.requires_grad}
    routed = _routed_gradients(trainer) if args.get("routing") else {}
    samples = make_samples(args["seed"], args["n"], trainer.hf_config.vocab_size)
    before = trainer.logprobs(samples)
    trainer.export_hf(outdir / "export0")
    perturb_behaviour(samples, before, args["seed"])
    from megatron.core import parallel_state as ps

    share = samples[ps.get_data_parallel_rank()::ps.get_data_parallel_world_size()]
    metrics = trainer.train_step(share)
    grads = dict(iter_hf_weights(trainer.model, trainer.hf_config, grads=True))  # the step's gradients
    after = trainer.logprobs(samples)
    trainer.export_hf(outdir / "export1")
    trainer.save(outdir / "ckpt")  # adapters + their Adam state; resume must be exact
    m_direct = trainer.train_step(share)
    w_direct = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    trainer.load(outdir / "ckpt")
    m_resumed = trainer.train_step(share)
    resume_diff = max(float((p.detach() - w_direct[n]).abs().max()) for n, p in gpt.named_parameters())
    base_moved = max(float((p - base_before[n]).abs().max()) for n, p in gpt.named_parameters()
                     if n in base_before)
    state_names = {n for n, p in gpt.named_parameters() if p in trainer.optimizer.state}
    if torch.distributed.get_rank() == 0:
        save_file({f"before.{i}": torch.from_numpy(a) for i, a in enumerate(before)}
                  | {f"after.{i}": torch.from_numpy(a) for i, a in enumerate(after)},
                  str(outdir / "logprobs.safetensors"))
        save_file({k: v.contiguous() for k, v in grads.items()}, str(outdir / "grads.safetensors"))
    (outdir / f"result{torch.distributed.get_rank()}.json").write_text(json.dumps({
        "metrics": metrics, "base_moved": base_moved, "routed": routed, "resume_diff": resume_diff,
        "resume_loss": [m_direct["loss"], m_resumed["loss"]],
        "state_all_adapters": all(n.rpartition(".")[2] in ("lora_A", "lora_B") for n in state_names),
        "state_count": len(state_names), "trainable": [n for n, p in gpt.named_parameters() if p.requires_grad]}))
    trainer.close()


def peft_logprobs(base_dir: Path, adapter_dir: Path, samples) -> list[np.ndarray]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.completion_ids]))[None]
            logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
            p = len(s.prompt_ids)
            out.append(logp[p - 1:-1].gather(-1, ids[0, p:, None])[:, 0].numpy())
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-ckpts")
    return {kind: sharpened_checkpoint(kind, root / kind) for kind in ("dense", "moe")}


N_SAMPLES = 8


def _run(kind, world, parallel, model_dir, outdir):
    from safetensors import safe_open

    args = {"model_dir": str(model_dir), "seed": 3, "n": N_SAMPLES, "lora": LORA, "parallel": parallel,
            "routing": kind == "moe"}
    launch("oracle", world, outdir, args, script=Path(__file__))
    with safe_open(str(outdir / "logprobs.safetensors"), "np") as f:
        before = [f.get_tensor(f"before.{i}") for i in range(N_SAMPLES)]
        after = [f.get_tensor(f"after.{i}") for i in range(N_SAMPLES)]
    return outdir, before, after


@pytest.fixture(scope="module")
def single_rank(checkpoints, tmp_path_factory):
    """The one-rank run of each kind (its directory and logprobs), run once per module."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _run(kind, 1, {}, checkpoints[kind], tmp_path_factory.mktemp(f"single-{kind}"))
        return cache[kind]
    return get


@pytest.mark.engine
@pytest.mark.parametrize("kind,world,parallel", [
    ("dense", 1, {}), ("moe", 1, {}), ("dense", 2, {"tp": 2}), ("moe", 2, {"ep": 2}),
    # 4 ranks on 2 cores: minutes; expert adapters need expert-TP 1 (docs/lora.md)
    pytest.param("moe", 4, {"tp": 2, "ep": 2, "etp": 1}, marks=pytest.mark.slow),
], ids=["dense-tp1", "moe-tp1", "dense-tp2", "moe-ep2", "moe-tp2ep2"])
def test_lora_logprobs_match_peft(kind, world, parallel, checkpoints, single_rank, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from pipeline.trainer.model import load_hf_config

    n = N_SAMPLES
    run = single_rank(kind) if world == 1 else _run(kind, world, parallel, checkpoints[kind], tmp_path)
    outdir, before, after = run
    samples = make_samples(3, n, 512)
    ref_before = peft_logprobs(checkpoints[kind], outdir / "export0", samples)
    ref_after = peft_logprobs(checkpoints[kind], outdir / "export1", samples)
    err_before = max(float(np.abs(a - b).max()) for a, b in zip(before, ref_before))
    err_after = max(float(np.abs(a - b).max()) for a, b in zip(after, ref_after))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(before, after))
    results = [json.loads((outdir / f"result{r}.json").read_text()) for r in range(world)]
    res = results[0]
    print(f"\n[{kind} x{world} {parallel}] max |megatron - peft| logprob: {err_before:.2e} (drawn adapters), "
          f"{err_after:.2e} (after a step); step moved logprobs by {moved:.3f}; trainable parameters "
          f"{res['metrics']['trainable_params']:.0f}")
    assert err_before < PEFT_LOGPROB_TOL and err_after < PEFT_LOGPROB_TOL
    assert moved > 10 * PEFT_LOGPROB_TOL, "the LoRA step did not change the model"
    if world > 1:  # the same adapters and the same step on one rank
        _, ref_before_one, ref_after_one = single_rank(kind)
        layout_before = max(float(np.abs(a - b).max()) for a, b in zip(before, ref_before_one))
        layout_err = max(float(np.abs(a - b).max()) for a, b in zip(after, ref_after_one))
        print(f"  max |{parallel} - one rank| logprob: {layout_before:.2e} (drawn adapters), "
              f"{layout_err:.2e} (after the step)")
        assert layout_before < PEFT_LOGPROB_TOL, "the adapters were drawn differently on this layout"
        grads, ref_grads = (load_file(str(d / "grads.safetensors")) for d in (outdir, single_rank(kind)[0]))
        assert grads.keys() == ref_grads.keys()
        grad_err = {k: float((grads[k] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for k, g in ref_grads.items()}
        worst = max(grad_err, key=grad_err.get)
        print(f"  adapter gradients: max |{parallel} - one rank| / max |one rank| per tensor "
              f"{grad_err[worst]:.1e} ({worst})")
        assert grad_err[worst] < LAYOUT_GRAD_REL_TOL, f"the step's gradient differs from one rank's: {worst}"
        assert layout_err < PEFT_LOGPROB_TOL
    ckpt = json.loads((outdir / "ckpt" / "model.safetensors.index.json").read_text())["weight_map"]
    meta = json.loads((outdir / "ckpt" / "trainer.json").read_text())
    assert ckpt and all(".lora_A." in k or ".lora_B." in k for k in ckpt), "the checkpoint holds base weights"
    assert meta["lora"]["rank"] == LORA["rank"] and meta["lora"]["base"] == str(checkpoints[kind].resolve())
    for r in results:
        assert r["resume_diff"] == 0.0 and r["resume_loss"][0] == r["resume_loss"][1], "resume is not exact"
        assert r["base_moved"] == 0.0, "a frozen base weight changed"
        assert r["state_all_adapters"] and r["state_count"] == len(r["trainable"]) > 0
        assert all(n.rpartition(".")[2] in ("lora_A", "lora_B") for n in r["trainable"])
    hf = load_hf_config(checkpoints[kind])
    with safe_open(str(outdir / "export1" / "adapter_model.safetensors"), "pt") as f:
        exported = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys())
    # q/k/v (and dense gate/up) share one A in the trainer; PEFT stores it once per projection.
    copies = 2 if kind == "moe" else 3
    assert exported - hf.num_hidden_layers * copies * LORA["rank"] * hf.hidden_size == \
        res["metrics"]["trainable_params"]
    if kind == "moe":
        routed = {f"rank{i}:{k}": v for i, r in enumerate(results) for k, v in r["routed"].items()}
        idle = [k for k, (n_tok, _) in routed.items() if n_tok == 0]
        used = [k for k, (n_tok, _) in routed.items() if n_tok > 0]
        assert idle and used, f"the probe should leave some experts without tokens: {routed}"
        assert all(g == 0.0 for k in idle for g in routed[k][1]), "an expert without tokens got a gradient"
        assert all(min(routed[k][1]) > 0.0 for k in used), "an expert with tokens got no gradient"
        print(f"  experts with tokens: {len(used)} (adapter gradients > 0), without: {len(idle)} (exactly 0)")


def test_refused_lora_settings():
    from pipeline.trainer.config import LoraConfig, ParallelConfig
    from pipeline.trainer.lora import check_lora_config, select_targets

    names = ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp.linear_fc1"]
    with pytest.raises(ValueError, match="'router' matches no adaptable module"):
        select_targets(names, LoraConfig(rank=4, targets=["linear_qkv", "router"]))
    assert select_targets(names, LoraConfig(rank=4, targets=["qkv"])) == names[:1]
    with pytest.raises(ValueError, match="dropout > 0 with trainer.parallel.tp > 1"):
        check_lora_config(LoraConfig(rank=4, dropout=0.1), ParallelConfig(tp=2))
    with pytest.raises(ValueError, match="alpha must be > 0"):
        check_lora_config(LoraConfig(rank=4, alpha=0), ParallelConfig())
    with pytest.raises(ValueError, match="not a regular expression"):
        check_lora_config(LoraConfig(rank=4, targets=["("]), ParallelConfig())


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    globals()[f"scenario_{sys.argv[1]}"](Path(sys.argv[2]), json.loads(sys.argv[3]))
