"""scripts/setup-venv.sh picks the build from the machine: the GPU extra where an NVIDIA driver
lists a GPU, the CPU extra elsewhere. Driven with a stand-in driver (an `nvidia-smi` that lists
one GPU) and a stand-in venv whose pip and python record what they were asked (no install)."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def setup_venv(tmp_path: Path, gpu: bool) -> list[str]:
    venv, tools = tmp_path / "venv", tmp_path / "bin"
    (venv / "bin").mkdir(parents=True)
    tools.mkdir()
    log = tmp_path / "calls"
    _script(venv / "bin" / "pip", f'echo "pip $*" >> {log}\n')
    _script(venv / "bin" / "python", f'echo "python $*" >> {log}\n')
    if gpu:
        _script(tools / "nvidia-smi", 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    env = dict(os.environ, TOKENFLOW_VENV=str(venv), PATH=f"{tools}:{os.environ['PATH']}")
    env.pop("TOKENFLOW_BUILD", None)
    out = subprocess.run(["bash", str(REPO / "scripts" / "setup-venv.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return log.read_text().splitlines()


def test_setup_venv_builds_the_gpu_extra_on_an_nvidia_machine(tmp_path):
    calls = setup_venv(tmp_path, gpu=True)
    installs = [c for c in calls if c.startswith("pip install")]
    assert any(".[gpu,test" in c for c in installs), calls
    assert not any("torch==2.13.0" in c or ".[cpu" in c for c in installs), calls  # no CPU torch pinned


def test_setup_venv_builds_the_cpu_extra_without_a_driver(tmp_path):
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has an NVIDIA driver (/dev/nvidia0): the script builds the GPU extra here")
    calls = setup_venv(tmp_path, gpu=False)
    assert any(".[cpu,test" in c for c in calls if c.startswith("pip install")), calls
