"""One section of the prepared GPU check (scripts/gpu_check.sh runs them all, one process each).

    python scripts/gpu_check.py --section NAME --json FILE [--work DIR]

Sections (each merges ``{NAME: {...}}`` into FILE at once, so a later timeout keeps what ran):
  megatron_bf16  the tiny dense and MoE models as bf16 megatron-core on CUDA (distributed
                 optimizer, fp32 masters, the packed layout's varlen attention) against transformers' logprobs of the same weights:
                 megatron's bf16 error (against transformers in fp32) must stay within twice
                 transformers' own bf16 error plus 1e-3;
  checkpoint     save after a step, step, load, step again: weights, fp32 masters and loss exactly
                 as without the detour; the masters are stored (not their bf16 rounding); Adam's
                 step is recorded;
  cuda_ipc       the CUDA IPC weight channel between two processes on one GPU over 3 versions of
                 40 one-bucket tensors: the receiver's copies are queued behind a GPU sleep and the
                 sender overwrites each buffer right after its acknowledgement (the next bucket
                 goes into it; the last two are filled with 0xAB): received checksums must equal
                 the sent ones (fails without the stream synchronisation before each ack);
  nccl_channel   the weight channel's failure scenario over NCCL (tests/support/weight_group_faults.py:
                 a member that never joins, one killed and one stopped mid-broadcast; each must end in
                 WeightSyncError on the survivors and a regroup, never a process teardown); needs 4
                 GPUs, says "skipped" with fewer (not in gpu_check.sh's 5-minute run: call it alone);
  optimizer_offload  the tiny MoE, bf16, megatron's distributed optimizer with
                 trainer.optimizer_offload_fraction 1.0 (HybridDeviceOptimizer: state and update on the
                 host) against 0.0, from the same weights on the same samples: the second step's loss
                 equal within 1e-3 relative, and the GPU's peak lower with the state on the host;
  throughput     a ~1B-parameter Qwen3 model built locally, bf16, packed layout (torch's
                 varlen_attn), 4k- and 16k-token sequences: trainer tokens/s, model-FLOPs
                 utilisation (6 N + 6 L d S FLOPs per token against 989 TFLOP/s bf16 dense for
                 H100/H200) and peak GPU memory at each length.
Every section records its peak GPU memory. Without a GPU the script says so and exits 3.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the test oracle (support.oracle)

from pipeline.launch.rendezvous import free_port  # noqa: E402

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16, SXM (NVIDIA data sheets)


def trainer_for(model_dir: Path, **overrides):
    from pipeline.trainer.config import ParallelConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer

    cfg = TrainerConfig(model_dir=str(model_dir), parallel=ParallelConfig(params_dtype="bfloat16"), lr=1e-4,
                        grad_clip=1.0, timeout_s=300, **overrides)
    return Trainer(cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}")


def hf_logprobs(model_dir: Path, samples, dtype) -> list:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).cuda().eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.completion_ids]))[None].cuda()
            logp = model(ids).logits[0].float().log_softmax(-1)
            p = len(s.prompt_ids)
            out.append(logp[p - 1:-1].gather(-1, ids[0, p:, None])[:, 0].cpu().numpy())
    del model
    return out


def _max_err(a, b) -> float:
    import numpy as np

    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def section_megatron_bf16(work: Path) -> dict:
    import torch
    from support.oracle import make_samples, sharpened_checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    for kind in ("dense", "moe"):
        ckpt = sharpened_checkpoint(kind, work / f"{kind}-sharp")
        trainer = trainer_for(ckpt)
        try:
            samples = make_samples(1, 16, trainer.hf_config.vocab_size)
            megatron = trainer.logprobs(samples)
            optimizer = trainer.optimizer_kind
        finally:
            trainer.close()
        fp32 = hf_logprobs(ckpt, samples, torch.float32)
        bf16 = hf_logprobs(ckpt, samples, torch.bfloat16)
        err, hf_err = _max_err(megatron, fp32), _max_err(bf16, fp32)
        out[kind] = {"megatron_bf16_vs_hf_fp32": err, "hf_bf16_vs_hf_fp32": hf_err, "optimizer": optimizer,
                     "ok": err <= 2 * hf_err + 1e-3 and optimizer == "megatron"}
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def section_checkpoint(work: Path) -> dict:
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from support.oracle import make_samples, sharpened_checkpoint

    from pipeline.trainer.model import iter_hf_weights

    ckpt = sharpened_checkpoint("moe", work / "moe-sharp")
    trainer = trainer_for(ckpt)
    try:
        samples = make_samples(3, 16, trainer.hf_config.vocab_size)
        for s, lp in zip(samples, trainer.logprobs(samples)):
            s.behaviour_logprobs = (lp - 0.05).astype(np.float32)
        trainer.train_step(samples)
        trainer.save(work / "ckpt")
        model_weights = dict(iter_hf_weights(trainer.model, trainer.hf_config))  # bf16 values
        direct = trainer.train_step(samples)
        w_direct = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.load(work / "ckpt")
        resumed = trainer.train_step(samples)
        weight_diff = max(float((p.detach() - w_direct[n]).abs().max()) for n, p in trainer.model.named_parameters())
    finally:
        trainer.close()
    stored = {n: t for f in sorted((work / "ckpt").glob("model-r*.safetensors")) for n, t in load_file(str(f)).items()}
    beyond_bf16 = any(not torch.equal(t, model_weights[n].float().cpu()) for n, t in stored.items())
    meta = json.loads((work / "ckpt" / "trainer.json").read_text())
    return {"weight_diff": weight_diff, "loss_direct": direct["loss"], "loss_resumed": resumed["loss"],
            "masters_stored": beyond_bf16, "adam_step": meta["adam_step"],
            "ok": weight_diff == 0.0 and direct["loss"] == resumed["loss"] and beyond_bf16 and meta["adam_step"] == 1}


def section_optimizer_offload(work: Path) -> dict:
    import numpy as np
    import torch
    from support.oracle import make_samples, sharpened_checkpoint

    ckpt = sharpened_checkpoint("moe", work / "moe-sharp")
    out = {}
    for fraction in (0.0, 1.0):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        trainer = trainer_for(ckpt, optimizer_offload_fraction=fraction)
        try:
            samples = make_samples(5, 16, trainer.hf_config.vocab_size)
            for s, lp in zip(samples, trainer.logprobs(samples)):
                s.behaviour_logprobs = (lp - 0.05).astype(np.float32)
            losses = [trainer.train_step(samples)["loss"] for _ in range(2)]
        finally:
            trainer.close()
        out[f"offload_{fraction:g}"] = {"losses": losses, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    on, off = out["offload_1"], out["offload_0"]
    out["ok"] = abs(on["losses"][1] - off["losses"][1]) <= 1e-3 * abs(off["losses"][1]) + 1e-6 \
        and on["peak_gib"] < off["peak_gib"]
    return out


IPC_VERSIONS, IPC_TENSORS = 3, 40
RECEIVER = """
import json, sys
sys.path.insert(0, %(repo)r)
import torch
from pipeline.weights.cuda_ipc import CudaIpcChannel
ch = CudaIpcChannel("127.0.0.1", %(port)d, rank=1, timeout_s=120, device=torch.device("cuda", 0), secret=bytes(32))
out = []
for _ in range(%(versions)d):
    update = ch.receive()
    got = {}
    for name, t in update:
        torch.cuda._sleep(20_000_000)  # the copy below runs well after the host moved on
        got[name] = t.clone()
    torch.cuda.synchronize()
    out.append({"version": update.version, "sums": {n: float(t.double().sum()) for n, t in got.items()}})
ch.close()
print(json.dumps(out))
"""


def section_cuda_ipc(work: Path) -> dict:
    import torch

    from pipeline.weights.cuda_ipc import CudaIpcChannel

    port = free_port('127.0.0.1')
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER % {"repo": str(REPO), "port": port,
                                                                   "versions": IPC_VERSIONS}],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sent = []
    try:
        ch = CudaIpcChannel("127.0.0.1", port, rank=0, timeout_s=120, device=torch.device("cuda", 0), secret=bytes(32))
        gen = torch.Generator(device="cuda").manual_seed(0)
        start = time.perf_counter()
        for v in range(IPC_VERSIONS):
            named = [(f"w{i}", torch.randn(512, 512, device="cuda", generator=gen)) for i in range(IPC_TENSORS)]
            sent.append({n: float(t.double().sum()) for n, t in named})
            ch.send_tensors(v, named, bucket_bytes=512 * 512 * 4)  # one tensor per bucket
            for k in (0, 1):  # the last two buckets' buffers, overwritten right after their acks
                buf = ch.buffers.held(k)
                if buf is not None:
                    buf.fill_(0xAB)
        seconds = time.perf_counter() - start
        stdout, stderr = receiver.communicate(timeout=180)
        ch.close()
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    if receiver.returncode != 0:
        return {"ok": False, "error": stderr[-3000:]}
    got = json.loads(stdout.strip().splitlines()[-1])
    wrong = [(v, n) for v, g in enumerate(got) for n, s in g["sums"].items() if s != sent[v][n]]
    return {"versions": IPC_VERSIONS, "tensors_per_version": IPC_TENSORS, "send_seconds": seconds,
            "wrong_tensors": len(wrong), "first_wrong": wrong[:3],
            "ok": not wrong and [g["version"] for g in got] == list(range(IPC_VERSIONS))}


def build_1b(out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    if (out / "config.json").exists():
        return out
    import inspect

    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}} \
        if "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters else {"rope_theta": 1e6}
    cfg = Qwen3Config(vocab_size=32768, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                      tie_word_embeddings=False, **rope)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    del model
    torch.cuda.empty_cache()
    return out


def section_throughput(work: Path) -> dict:
    """The packed layout (the default: `pipeline.trainer.attention` through torch's varlen_attn)
    on a ~1B model at 4k and 16k tokens per sequence: tokens/s, MFU and peak memory of each."""
    import numpy as np
    import torch

    from pipeline.trainer.layout import TrainSample

    model_dir = build_1b(work / "qwen3-1b")
    out = {}
    for seq, count in ((4096, 8), (16384, 2)):
        torch.cuda.reset_peak_memory_stats()
        trainer = trainer_for(model_dir, micro_batch_tokens=seq)
        try:
            hf = trainer.hf_config
            params = sum(p.numel() for p in trainer.model.parameters())
            rng = np.random.default_rng(0)
            samples = [TrainSample(rng.integers(3, hf.vocab_size, 96), rng.integers(3, hf.vocab_size, seq - 96),
                                   np.full(seq - 96, -6.0, np.float32), reward=float(i % 2), group_id=i // 4)
                       for i in range(count)]
            trainer.train_step(samples)  # warm-up
            torch.cuda.synchronize()
            start, tokens = time.perf_counter(), 0
            for _ in range(2):
                trainer.train_step(samples)
                tokens += len(samples) * seq
            torch.cuda.synchronize()
            tokens_per_s = tokens / (time.perf_counter() - start)
            layout = trainer.cfg.layout
        finally:
            trainer.close()
        flops_per_token = 6 * (params - hf.vocab_size * hf.hidden_size) + 6 * hf.num_hidden_layers * hf.hidden_size * seq
        name = torch.cuda.get_device_name(0)
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        out[str(seq)] = {"params": params, "seq_len": seq, "layout": layout, "tokens_per_s": tokens_per_s,
                         "model_flops_per_token": flops_per_token,
                         "mfu": tokens_per_s * flops_per_token / peak if peak else None,
                         "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    out["ok"] = all(v["tokens_per_s"] > 0 for v in out.values())
    return out


def section_nccl_channel(work: Path) -> dict:
    import shutil

    import torch

    from support import weight_group_faults

    if torch.cuda.device_count() < 4:  # NCCL refuses two ranks of one communicator on one GPU
        return {"ok": True, "skipped": f"needs 4 GPUs (one per member), this machine has "
                                       f"{torch.cuda.device_count()}"}
    where = work / "nccl_channel"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    deadline = 20.0
    outcome = weight_group_faults.run(where, "nccl", deadline)
    wrong = weight_group_faults.check(outcome, deadline)
    return {"errors": outcome["errors"], "wrong": wrong, "ok": not wrong}


SECTIONS = {"megatron_bf16": section_megatron_bf16, "checkpoint": section_checkpoint,
            "cuda_ipc": section_cuda_ipc, "optimizer_offload": section_optimizer_offload,
            "throughput": section_throughput, "nccl_channel": section_nccl_channel}


def record(path: Path, name: str, value: dict) -> None:
    """Merge ``{name: value}`` into the JSON file at ``path`` (written whole, then renamed)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = value
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", required=True, choices=[*SECTIONS, "environment"])
    parser.add_argument("--json", required=True, type=Path, help="the JSON file the section merges into")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tokenflow-gpu-check"), help="scratch directory")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch on this machine: nothing to check", file=sys.stderr)
        return 3
    args.work.mkdir(parents=True, exist_ok=True)
    if args.section == "environment":
        from importlib.metadata import version
        record(args.json, "environment", {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                          "python": sys.version.split()[0], "megatron_core": version("megatron-core"),
                                          "vllm": "not run: the check machine has no vLLM build (read from source)"})
        return 0
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        value = SECTIONS[args.section](args.work)
    except Exception:
        value = {"ok": False, "error": traceback.format_exc()[-3000:]}
    value["seconds"] = round(time.perf_counter() - start, 1)
    value["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    record(args.json, args.section, value)
    print(json.dumps({args.section: value}))
    return 0 if value["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
