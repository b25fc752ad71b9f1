"""``tokenflow plan``: per-rank memory of a trainer layout, or the layouts of N GPUs that fit.

    tokenflow plan --model configs/models/qwen3-30b-a3b.json --gpus 8 --gpu-memory 80GB --tokens 8192
    tokenflow plan --model tiny-moe --tp 2 --ep 2 --gpus 4 --tokens 1024 --dtype float32

``--model``: a ``config.json``, a directory holding one, a name under ``configs/models/`` (without
``.json``), or a model name Tokenflow resolves (``tiny-dense``, ``tiny-moe``, a Hub id it has cached).
With any of ``--tp --ep --pp --cp --recompute --offload`` the layout is the one given (exit status 2
when it does not fit, naming what binds); without them every layout of ``--gpus`` is tried and the
fitting ones are listed best first (`pipeline.plan.search`). Memory sizes: ``80GB`` = ``80GiB`` =
80 x 2^30 bytes (an "80 GB" GPU holds 80 GiB). The work is in `pipeline.plan`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.plan.memory import GiB, Layout, MemoryPlan, rank_memory
from pipeline.plan.search import USABLE, fitting, refusal
from pipeline.plan.shape import ModelShape

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


def parse_bytes(text: str) -> float:
    """``80GB``, ``80GiB``, ``80`` (GiB) or ``512MB`` -> bytes (powers of 1024)."""
    t = text.strip().upper().replace("IB", "B")
    for suffix, scale in (("TB", 1024 ** 4), ("GB", GiB), ("MB", 1024 ** 2), ("", GiB)):
        if t.endswith(suffix) and t[:len(t) - len(suffix)].replace(".", "", 1).isdigit():
            return float(t[:len(t) - len(suffix)]) * scale
    raise ValueError(f"cannot read a memory size from {text!r} (e.g. 80GB)")


def load_shape(model: str) -> ModelShape:
    """The shape of ``model`` (see the module docstring for what it may name)."""
    path = Path(model)
    if path.exists():
        return ModelShape.from_file(path)
    if (MODELS / f"{model}.json").is_file():
        return ModelShape.from_file(MODELS / f"{model}.json")
    from pipeline.models.defaults import model_config

    return ModelShape.from_config(model_config(model).to_dict())


def describe(plan: MemoryPlan) -> dict:
    L = plan.layout
    return {"tp": L.tp, "ep": L.ep, "etp": L.etp, "pp": L.pp, "cp": L.cp, "dp": L.dp, "expert_dp": L.expert_dp,
            "recompute": L.recompute, "offload": L.offload, "peak_gib": round(plan.peak / GiB, 2),
            "stage": plan.stage, "bubble": round(plan.bubble, 3), "kv_gather_mib": round(plan.kv_gather / 2**20, 2),
            "gib": {k: round(v / GiB, 2) for k, v in plan.components.items()},
            "activation_bytes_per_token_layer": {k: round(v) for k, v in plan.activations_per_token.items()}}


def text(plan: MemoryPlan) -> str:
    L = plan.layout
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.components.items())
    per_token = ", ".join(f"{k} {v / 1024:.1f}" for k, v in plan.activations_per_token.items())
    return (f"tp {L.tp} ep {L.ep} etp {L.etp} pp {L.pp} cp {L.cp} (dp {L.dp}, expert-dp {L.expert_dp}), "
            f"recompute {L.recompute}, offload {L.offload:g}: peak {plan.peak / GiB:.2f} GiB"
            f" (stage {plan.stage}, bubble {plan.bubble:.0%}"
            + (f", K/V all-gather {plan.kv_gather / 2**20:.1f} MiB per layer and micro-batch" if L.cp > 1 else "")
            + f")\n    GiB: {parts}\n"
            f"    activations per token and layer (KiB): {per_token}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenflow plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="config.json, its directory, a configs/models name or a model name")
    ap.add_argument("--gpus", type=int, default=1, help="trainer ranks (GPUs)")
    ap.add_argument("--gpu-memory", default="80GB", help="memory of one GPU (e.g. 80GB)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096], help="tokens per micro-batch (one row each)")
    ap.add_argument("--rows", type=int, default=1, help="rows (sequences) per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (pipeline bubble)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--optimizer", default="megatron", choices=("megatron", "torch"))
    ap.add_argument("--attention", default="flash", choices=("flash", "local"),
                    help="flash: the trainer's per-sequence attention, no S x S tensor (both trainer.layout "
                         "values); local: megatron-core's own local attention with its S x S scores (no "
                         "trainer layout uses it)")
    ap.add_argument("--logits-chunk", type=int, default=1024,
                    help="tokens whose fp32 logits exist at once (trainer.logprob_chunk_tokens)")
    ap.add_argument("--reference", action="store_true", help="a KL reference model is held")
    for name in ("tp", "ep", "pp", "cp"):
        ap.add_argument(f"--{name}", type=int)
    ap.add_argument("--etp", type=int)
    ap.add_argument("--recompute", choices=("none", "selective", "full"))
    ap.add_argument("--offload", type=float)
    ap.add_argument("--json", action="store_true", help="one JSON object per length")
    args = ap.parse_args(argv)
    try:
        shape = load_shape(args.model)
        gpu_bytes = parse_bytes(args.gpu_memory)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"tokenflow plan: {exc}", file=sys.stderr)
        return 2
    fixed = {k: getattr(args, k) for k in ("tp", "ep", "etp", "pp", "cp", "recompute", "offload")
             if getattr(args, k) is not None}
    etp = fixed.pop("etp", 1)  # expert TP: 1 unless given (megatron's advice for MoE; dense models have none)
    status = 0
    for tokens in args.tokens:
        base = Layout(world=args.gpus, micro_batch_tokens=tokens * args.rows, seq_len=tokens,
                      micro_batches=args.micro_batches, params_dtype=args.dtype, optimizer=args.optimizer,
                      attention=args.attention, logits_chunk=args.logits_chunk, reference=args.reference,
                      etp=etp, **fixed)
        head = f"{args.model}: {tokens} tokens x {args.rows} row(s), {args.gpus} x {gpu_bytes / GiB:.0f} GiB"
        if fixed or args.etp is not None:
            try:
                plan = rank_memory(shape, base)
            except ValueError as exc:
                print(f"tokenflow plan: {exc}", file=sys.stderr)
                return 2
            why = refusal(plan, gpu_bytes)
            status = 2 if why else status
            if args.json:
                print(json.dumps({"tokens": tokens, "fits": why is None, "refusal": why, **describe(plan)}))
            else:
                print(f"{head}\n  {text(plan)}" + (f"\n  refused: {why}" if why else "\n  fits"))
            continue
        plans = fitting(shape, base, gpu_bytes)
        if args.json:
            print(json.dumps({"tokens": tokens, "fits": bool(plans), "layouts": [describe(p) for p in plans[:5]]}))
        elif plans:
            print(f"{head}: {len(plans)} layouts fit in {USABLE:.0%}; best first:")
            for p in plans[:3]:
                print(f"  {text(p)}")
        else:
            print(f"{head}: no layout fits in {USABLE:.0%} of the GPU")
        status = status if plans else 2
    return status
