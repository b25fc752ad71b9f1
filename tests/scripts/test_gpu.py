"""scripts/gpu_check.py: on CUDA (gpu marker) and, to keep the script itself honest, on CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_check(*flags: str, timeout: int) -> dict:
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), *flags],
                         capture_output=True, text=True, timeout=timeout, cwd=REPO,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    lines = out.stdout.strip().splitlines()
    assert lines, f"no output (rc {out.returncode}):\n{out.stderr[-3000:]}"
    result = json.loads(lines[-1])
    print("\n" + json.dumps(result, indent=1))
    return result


def _assert_ok(result: dict) -> None:
    for kind in ("dense", "moe"):
        r = result[kind]
        assert "error" not in r, r.get("error")
        assert r["hf_logprob_err_loaded"] < 1e-4 and r["hf_logprob_err_exported"] < 1e-4
        assert r["step_moved_logprobs"] > 1e-3
        assert r["train_tokens_per_s"] > 0
    assert result["ok"]


@pytest.mark.gpu
def test_gpu_check_on_cuda():
    result = run_check(timeout=600)
    assert result["device"] != "cpu"
    assert all(result[k]["optimizer"] == "megatron" for k in ("dense", "moe"))
    _assert_ok(result)


@pytest.mark.engine
def test_gpu_check_script_runs_on_cpu():
    result = run_check("--allow-cpu", "--quick", timeout=300)
    assert result["device"] == "cpu"
    _assert_ok(result)


@pytest.mark.gpu
def test_cuda_weight_packing_and_same_gpu_ipc_handover():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_weights_check.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print("\n" + json.dumps(result, indent=1))
    assert result["pack_unpack_identical"] and result["ipc_checksums_equal"], result
