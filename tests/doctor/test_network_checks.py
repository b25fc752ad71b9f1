"""`cluster.network` chosen, exported and checked: the variables every task gets, the doctor's
weights and network checks, and `tokenflow doctor --probe` on the local launcher and on the test
cluster (slurm/cluster/start.sh) with a second loopback address, where every task listens."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.apps.train import job_plan
from pipeline.config import TokenflowConfig, validate
from pipeline.doctor import run_checks
from pipeline.generator.vllm_args import resolve_weight_sync
from support.child_env import child_env

REPO = Path(__file__).resolve().parents[2]


def config(tmp_path, **network) -> TokenflowConfig:
    cfg = TokenflowConfig()
    cfg.run.dir = str(tmp_path / "run")
    for name, value in network.items():
        setattr(cfg.cluster.network, name, value)
    return cfg


def test_the_chosen_network_reaches_every_task_and_bad_choices_are_refused(tmp_path):
    cfg = config(tmp_path, interface="lo", address="127.0.0.2", ib_hca="mlx5_0",
                 nccl_env={"NCCL_IB_GID_INDEX": "3"})
    validate(cfg)
    assert job_plan(cfg, tmp_path / "run").env == {
        "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo", "TOKENFLOW_NETWORK_ADDRESS": "127.0.0.2",
        "VLLM_HOST_IP": "127.0.0.2", "NCCL_IB_HCA": "mlx5_0", "NCCL_IB_GID_INDEX": "3"}
    found = run_checks(cfg, job_plan(cfg, tmp_path / "run"))
    assert [f.text for f in found.findings if f.check == "network"][-1] == \
        "this node listens on 127.0.0.2 and reaches it"
    with pytest.raises(ValueError, match=re.escape("cluster.network.address='10.0.0.300' is not an IPv4")):
        validate(config(tmp_path, address="10.0.0.300"))
    with pytest.raises(ValueError, match=re.escape("cluster.network.nccl_env: 'PATH' is not an NCCL variable")):
        validate(config(tmp_path, nccl_env={"PATH": "/tmp"}))
    elsewhere = config(tmp_path, address="192.0.2.1")  # TEST-NET-1: no node here owns it
    validate(elsewhere)
    refusals = [f.text for f in run_checks(elsewhere, job_plan(elsewhere, tmp_path / "run")).refusals]
    assert len(refusals) == 1 and refusals[0].startswith("cluster.network.address: cannot listen on and reach 192.0.2.1")


def test_nccl_receives_streamed_by_default_and_a_staged_one_beside_tp_is_refused(tmp_path):
    cfg = config(tmp_path)
    g = cfg.generator
    assert resolve_weight_sync(g, "cpu") == "staged"  # the tiny model: under staged_max_gb
    assert resolve_weight_sync(g, "cuda") == "streamed"  # NCCL
    g.weight_channel = "cuda_ipc"
    assert resolve_weight_sync(g, "cuda") == "staged"  # no communicator of ours beside vLLM's
    g.weight_channel, g.weight_sync, g.tensor_parallel_size = "broadcast", "staged", 2
    cfg.cluster.trainer.gpus_per_node, cfg.cluster.generator.gpus_per_node = 1, 2
    cfg.cluster.gpus = 3
    validate(cfg)
    refusals = [f.text for f in run_checks(cfg, job_plan(cfg, tmp_path / "run")).refusals if f.check == "weights"]
    assert len(refusals) == 1 and "staged over NCCL with tensor_parallel_size=2" in refusals[0]
    g.weight_sync = "auto"
    weights = [f for f in run_checks(cfg, job_plan(cfg, tmp_path / "run")).findings if f.check == "weights"]
    assert [f.text.split(",")[0] for f in weights] == ["broadcast over NCCL"] and not weights[0].refused
    assert "streamed receive" in weights[0].text


def doctor_probe(*overrides: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "doctor", "--probe", *overrides],
                          capture_output=True, text=True, env=child_env(), timeout=timeout, cwd=REPO)


def probed(stdout: str) -> dict[str, tuple[str, str]]:
    """task -> (address listened on, peers reached) from the probe's lines."""
    return {m[0]: (m[1], m[2]) for m in re.findall(r"^\[probe\] (\S+) on \S+ listening on (\S+): reaches (.*)$",
                                                     stdout, re.M)}


def test_doctor_probe_every_local_task_reaches_every_other_on_the_chosen_address(tmp_path):
    out = doctor_probe("cluster.network.address=127.0.0.2", f"run.dir={tmp_path / 'run'}",
                       "cluster.generators=2", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    everyone = "trainer.0, generator.0, generator.1"
    assert probed(out.stdout) == {t: ("127.0.0.2", everyone) for t in ("trainer.0", "generator.0", "generator.1")}
    assert not list(tmp_path.glob("tokenflow-probe-*")), "the probe's directory is removed"


@pytest.mark.slurm
def test_doctor_probe_on_the_test_cluster_binds_the_second_loopback_address(tmp_path):
    """One heterogeneous job over the fake nodes: every task of both components listens on
    127.0.0.2 (TOKENFLOW_NETWORK_ADDRESS reached the Slurm tasks) and reaches every other."""
    out = doctor_probe("cluster=slurm", "cluster.network.address=127.0.0.2", f"run.dir={tmp_path / 'run'}",
                       "cluster.generators=1", "cluster.generator.nodes=1", "cluster.trainer.mem_gb=1",
                       "cluster.generator.mem_gb=1", "cluster.trainer.cpus_per_task=1",
                       "cluster.generator.cpus_per_task=1", "cluster.trainer.time_min=5",
                       "cluster.generator.time_min=5", timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    assert probed(out.stdout) == {t: ("127.0.0.2", "trainer.0, generator.0") for t in ("trainer.0", "generator.0")}
