"""GPU check of weight hand-over: packed buckets on CUDA, and a same-GPU hand-over between two
processes through CUDA IPC handles (NCCL refuses two ranks on one device).

    python scripts/gpu_weights_check.py            # prints one JSON object (last line)

1. the tiny MoE model's weights (Hugging Face names) are packed into CUDA buckets and unpacked:
   every tensor must come back bit-identical; packing bandwidth is reported;
2. a second process opens the buckets through CUDA IPC and returns per-tensor checksums, which
   must equal the sender's; the hand-over time (export -> receiver done) is reported.
Run by scripts/gpu_check.py as one section; on a machine without CUDA it exits with a message.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECEIVER = """
import json, sys
sys.path.insert(0, %r)
import torch
from pipeline.weights.cuda_ipc import import_buckets
version, plan, tensors = import_buckets(sys.stdin.buffer.read())
sums = {name: float(t.double().sum().item()) for name, t in tensors}
torch.cuda.synchronize()
print(json.dumps({"version": version, "sums": sums}))
"""


def named_weights(quick: bool):
    import torch
    from safetensors.torch import load_file

    from pipeline.models.tiny import ensure_tiny_model

    path = ensure_tiny_model("moe")
    named = sorted(load_file(str(path / "model.safetensors")).items())
    if not quick:  # also a larger set: 200 tensors, ~256 MB in all
        named += [(f"synthetic.{i}", torch.randn(640, 512)) for i in range(200)]
    return named


def check(quick: bool = False) -> dict:
    import torch

    from pipeline.weights.buckets import BucketPlan, pack, unpack
    from pipeline.weights.cuda_ipc import export_buckets

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    named = [(n, t.cuda()) for n, t in named_weights(quick)]
    plan = BucketPlan.for_tensors(named, 64 * 2**20)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    buckets = list(pack(plan, named, device=torch.device("cuda")))
    torch.cuda.synchronize()
    pack_s = time.perf_counter() - t0
    back = dict(kv for slots, b in zip(plan.buckets, buckets) for kv in unpack(slots, b))
    identical = all(torch.equal(back[n], t) for n, t in named)
    sums = {n: float(t.double().sum().item()) for n, t in named}
    t1 = time.perf_counter()
    export = export_buckets(7, plan, buckets)
    out = subprocess.run([sys.executable, "-c", RECEIVER % str(REPO)], input=export.document,
                         capture_output=True, timeout=300)
    handover_s = time.perf_counter() - t1
    export.release()
    if out.returncode != 0:
        return {"ok": False, "error": out.stderr.decode()[-2000:]}
    got = json.loads(out.stdout.decode().strip().splitlines()[-1])
    ipc_ok = got["version"] == 7 and got["sums"] == sums
    return {"ok": bool(identical and ipc_ok), "tensors": len(named), "bytes": plan.total_bytes,
            "pack_unpack_identical": bool(identical), "pack_GBps": plan.total_bytes / pack_s / 1e9,
            "ipc_checksums_equal": bool(ipc_ok), "ipc_handover_s_incl_process_start": handover_s}


if __name__ == "__main__":
    result = check("--quick" in sys.argv)
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)
