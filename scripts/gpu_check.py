"""The one GPU check of the trainer: megatron-core on CUDA over NCCL (one rank).

For the tiny dense and MoE models (weights re-drawn at unit scale, tests/support/oracle.py):
  1. trainer logprobs vs Hugging Face transformers on the same GPU (float32, TF32 off);
  2. one train step with megatron's distributed optimizer, then HF export -> transformers load ->
     logprobs vs the trainer's (the weight conversion/gather path on CUDA);
  3. a checkpoint save and restore (megatron's distributed optimizer on CUDA): the step after the
     restore equals the step after the save; MoE routing statistics (expert loads sum to 1);
  4. train-step throughput (tokens/s) on a larger batch;
  5. weight packing on CUDA and a same-GPU hand-over through CUDA IPC (scripts/gpu_weights_check.py).
Not covered here: vLLM (the check machine cannot install it), packed (THD) batches (no packed
layout yet: the padded layout runs on GPU too).

Usage (about 1-3 minutes on one H200; megatron-core >= 0.17 is needed on Python 3.12 and may be
installed from a wheel directory shipped with the tree):
    python scripts/gpu_check.py [--wheel-dir DIR] [--out DIR] [--quick] [--allow-cpu]
``--allow-cpu`` runs the same checks on CPU over gloo (to test this script without a GPU).
The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HF_LOGPROB_TOL = 1e-4  # max |megatron - transformers| per-token logprob, float32


def ensure_megatron(wheel_dir: str | None) -> str:
    """megatron-core's version, installing it offline from ``wheel_dir`` if it is missing."""
    try:
        from importlib.metadata import version

        import megatron.core  # noqa: F401

        return version("megatron-core")
    except ImportError:
        if not wheel_dir:
            raise SystemExit("megatron-core is not installed; pass --wheel-dir with a "
                             "megatron_core wheel for this Python (>= 0.17 on Python 3.12)")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", wheel_dir,
                    "megatron-core"], check=True, timeout=300)
    from importlib.metadata import version

    return version("megatron-core")


def check_model(kind: str, workdir: Path, quick: bool) -> dict:
    """Oracle + step + export + throughput for one model kind; returns its numbers."""
    import numpy as np
    import torch

    from pipeline.launch.rendezvous import free_port
    from pipeline.trainer.config import TrainerConfig
    from pipeline.trainer.engine import Trainer
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test oracle
    from support.oracle import hf_logprobs, make_samples, sharpened_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ckpt = sharpened_checkpoint(kind, workdir / f"{kind}-sharp")
    cfg = TrainerConfig(model_dir=str(ckpt), lr=1e-4, grad_clip=1.0, micro_batch_tokens=8192,
                        timeout_s=300)
    trainer = Trainer(cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}")
    try:
        samples = make_samples(1, 16, trainer.hf_config.vocab_size)
        before = trainer.logprobs(samples)
        ref = hf_logprobs(ckpt, samples, device)
        err_before = max(float(np.abs(a - b).max()) for a, b in zip(before, ref))
        for s, lp in zip(samples, before):
            s.behaviour_logprobs = (lp - 0.05).astype(np.float32)
        metrics = trainer.train_step(samples)
        after = trainer.logprobs(samples)
        export = trainer.export_hf(workdir / f"{kind}-export")
        err_after = max(float(np.abs(a - b).max())
                        for a, b in zip(after, hf_logprobs(export, samples, device)))
        moved = max(float(np.abs(a - b).max()) for a, b in zip(before, after))

        # checkpoint save/restore (the distributed optimizer on CUDA): the step after a restore
        # must equal the step taken straight after the save
        trainer.save(workdir / f"{kind}-ckpt")
        direct = trainer.train_step(samples)
        w_direct = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.load(workdir / f"{kind}-ckpt")
        resumed = trainer.train_step(samples)
        resume_err = max(float((p.detach() - w_direct[n]).abs().max())
                         for n, p in trainer.model.named_parameters())
        resume_err = max(resume_err, abs(direct["loss"] - resumed["loss"]))
        routing = {k: v for k, v in metrics.items() if k.startswith("moe_")}
        loads_ok = all(abs(sum(v for k, v in routing.items() if k.startswith(f"moe_load_l{layer}_")) - 1) < 1e-6
                       for layer in range(trainer.hf_config.num_hidden_layers)) if routing else True

        big = make_samples(2, 32 if quick else 256, trainer.hf_config.vocab_size,
                           min_len=64, max_len=256)
        for s in big:
            s.behaviour_logprobs = np.full(len(s.completion_ids), -6.0, np.float32)
        trainer.train_step(big)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        steps = 1 if quick else 3
        tokens = 0
        for _ in range(steps):
            tokens += trainer.train_step(big)["tokens"]
        if device == "cuda":
            torch.cuda.synchronize()
        tokens_per_s = tokens / (time.perf_counter() - start)
    finally:
        trainer.close()
    return {"hf_logprob_err_loaded": err_before, "hf_logprob_err_exported": err_after,
            "step_moved_logprobs": moved, "step_loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"], "optimizer": trainer.optimizer_kind,
            "train_tokens_per_s": tokens_per_s, "checkpoint_resume_err": resume_err,
            "routing": {k: v for k, v in routing.items() if not k.startswith("moe_load_")},
            "ok": err_before < HF_LOGPROB_TOL and err_after < HF_LOGPROB_TOL and moved > 1e-3
            and resume_err < 1e-6 and loads_ok and (kind != "moe" or bool(routing))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel-dir", help="directory with a megatron_core wheel to install offline")
    parser.add_argument("--out", help="work directory (default: a temporary one)")
    parser.add_argument("--quick", action="store_true", help="smaller throughput batch")
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU/gloo if there is no GPU")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("no CUDA device (use --allow-cpu to exercise this script on CPU)")
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    result = {"megatron_core": ensure_megatron(args.wheel_dir), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "vllm": "not checked: the GPU check machine cannot install vLLM",
              "packed_layout": "not implemented: the padded layout is used on GPU too"}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.out or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for kind in ("dense", "moe"):
            try:
                result[kind] = check_model(kind, workdir, args.quick)
            except Exception as exc:  # report every model, then fail below
                result[kind] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        if torch.cuda.is_available():
            from gpu_weights_check import check as check_weights
            try:
                result["weights"] = check_weights(args.quick)
            except Exception as exc:
                result["weights"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    result["wall_s"] = time.perf_counter() - start
    result["ok"] = all(result[k]["ok"] for k in ("dense", "moe", "weights") if k in result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
