"""scripts/gpu_check.sh, the one prepared GPU check: its sections on CUDA (gpu marker), and on a
machine without a GPU its refusal (says so, exits 3, no traceback)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_gpu_check_on_cuda(tmp_path):
    """All sections within 5.5 minutes: megatron bf16 vs transformers, distributed-optimizer
    checkpoint and exact resume, CUDA IPC under buffer reuse, optimizer offload, ~1B throughput and MFU."""
    out = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "gpu.json")],
                         capture_output=True, text=True, timeout=360, cwd=REPO)
    result = json.loads((tmp_path / "gpu.json").read_text())
    print("\n" + json.dumps(result, indent=1))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert all(result[s]["ok"] for s in ("megatron_bf16", "checkpoint", "cuda_ipc", "optimizer_offload", "throughput"))


@pytest.mark.gpu
def test_cuda_ipc_receiver_synchronises_before_each_ack(tmp_path):
    """Two processes on one GPU; the sender overwrites each buffer right after its ack."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--section", "cuda_ipc",
                          "--json", str(tmp_path / "ipc.json"), "--work", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    result = json.loads((tmp_path / "ipc.json").read_text())["cuda_ipc"]
    assert out.returncode == 0 and result["wrong_tensors"] == 0, result


def test_gpu_check_without_a_gpu_says_so(tmp_path):
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has an NVIDIA GPU: the check runs instead of refusing")
    env = dict(os.environ, PATH="/usr/bin:/bin", PYTHON=sys.executable)  # no nvidia-smi on the path
    sh = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "gpu.json")],
                        capture_output=True, text=True, timeout=60, env=env)
    assert sh.returncode == 3 and "no NVIDIA GPU" in sh.stderr and "Traceback" not in sh.stdout + sh.stderr
    py = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--section", "cuda_ipc",
                         "--json", str(tmp_path / "gpu.json")], capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert py.returncode == 3 and "no CUDA GPU" in py.stderr and "Traceback" not in py.stdout + py.stderr
    assert not (tmp_path / "gpu.json").exists()
