"""GPU placement without GPUs: which devices each task is confined to is an environment variable,
so the local launcher's real tasks (the probe role) show it on a CPU machine; `tokenflow doctor`
and `tokenflow train` refuse plans the machine cannot run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.apps.train import job_plan, train
from pipeline.config import TokenflowConfig, validate
from pipeline.launch import LocalLauncher
from pipeline.launch.plan import ComponentSpec

REPO = Path(__file__).resolve().parents[2]
PROBE = "pipeline.launch.probe:probe"


def gpu_config(tmp_path, trainer_gpus: int, generator_gpus: int, **cluster) -> TokenflowConfig:
    cfg = TokenflowConfig()
    cfg.run.dir = str(tmp_path / "run")
    for name, value in cluster.items():
        setattr(cfg.cluster, name, value)
    cfg.cluster.trainer.gpus_per_node = trainer_gpus
    cfg.cluster.generator.gpus_per_node = generator_gpus
    return cfg


def test_local_components_get_disjoint_gpus_and_a_gpuless_task_none(tmp_path, monkeypatch):
    """2 trainer ranks and 2 generators with a GPU each on a node whose GPUs are 4-7: the
    generators come after the trainer (on the old code both started at the node's first GPU), and
    a task asking for none sees none (the old code left it every GPU)."""
    cfg = gpu_config(tmp_path, 2, 2, trainer_ranks=2, generators=2)
    plan = job_plan(cfg, tmp_path / "run")
    plan.components["scorer"] = ComponentSpec(entry=PROBE)  # a third component, asking for no GPU
    for spec in plan.components.values():
        spec.entry = PROBE
    plan.config["probe"] = {"timeout_s": 60}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    results = LocalLauncher().launch(plan, tmp_path / "run").wait(timeout_s=180)
    placed = {(r["role"], r["rank"]): (r["gpus"], r["local_rank"]) for rs in results.values() for r in rs}
    assert placed == {("trainer", 0): ("4", "0"), ("trainer", 1): ("5", "0"),
                      ("generator", 0): ("6", "0"), ("generator", 1): ("7", "0"),
                      ("scorer", 0): ("", "0")}


@pytest.mark.parametrize("distribution,localids", [("block", [0, 1, 0, 1]), ("cyclic", [0, 0, 1, 1])])
def test_slurm_task_gpus_follow_slurm_localid(distribution, localids):
    """2 nodes x 2 tasks, 4 GPUs per node, Slurm binding the node's GPUs to each task: the slice
    follows SLURM_LOCALID; ranks on one node never share a GPU under either distribution."""
    from pipeline.launch.gpus import slurm_gpus

    spec = ComponentSpec(entry=PROBE, nodes=2, tasks_per_node=2, gpus_per_node=4)
    nodes = [0, 1, 0, 1] if distribution == "cyclic" else [0, 0, 1, 1]
    got = {}
    for rank, (node, local) in enumerate(zip(nodes, localids)):
        got[rank] = (node, tuple(slurm_gpus(spec, {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_LOCALID": str(local)})))
    for node in (0, 1):
        slices = [g for n, g in got.values() if n == node]
        assert sorted(slices) == [("0", "1"), ("2", "3")], got
    assert slurm_gpus(spec, {"CUDA_VISIBLE_DEVICES": "3,7", "SLURM_LOCALID": "1"}) == ["3", "7"]  # bound per task


def test_one_gpu_colocates_trainer_and_generator_with_cuda_ipc(tmp_path):
    cfg = gpu_config(tmp_path, 0, 0, gpus=1)
    validate(cfg)
    plan = job_plan(cfg, tmp_path / "run")
    assert cfg.generator.weight_channel == "cuda_ipc" and cfg.generator.gpu_memory_utilization <= 0.45
    assert (plan.components["trainer"].gpu_first, plan.components["generator"].gpu_first) == (0, 0)
    two = gpu_config(tmp_path, 0, 0, gpus=2)
    validate(two)
    plan = job_plan(two, tmp_path / "run")
    assert two.generator.weight_channel == "broadcast"
    assert (plan.components["trainer"].gpu_first, plan.components["generator"].gpu_first) == (0, 1)


def doctor(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "doctor", *overrides], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=env)


def test_doctor_prints_the_default_plan_and_refuses_missing_gpus_and_a_tp_beyond_them(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ok = doctor(cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for line in ("[placement] this node: 0 GPU(s)", "[placement] trainer.0: GPUs none",
                 "[placement] generator.0: GPUs none", "[engine] model runner", "[trainer] megatron-core 0.16.1",
                 "[checkpoint] model tiny-moe: Qwen3MoeForCausalLM, head size 64"):
        assert line in ok.stdout, ok.stdout

    from pipeline.apps.doctor import diagnose  # the same checks on a structured config, in-process

    bad = gpu_config(tmp_path, 1, 1)
    bad.generator.tensor_parallel_size = 2
    assert diagnose(bad) == 2
    out = capsys.readouterr().out
    assert "refused: [placement] trainer asks for 1 GPU(s) per node from GPU 0 on; this node has 0" in out
    assert "refused: [engine] generator.tensor_parallel_size=2 is larger than the 1 GPU(s) each engine has" in out


def test_train_runs_the_doctors_checks_before_anything_starts(tmp_path, capsys):
    cfg = gpu_config(tmp_path, 1, 0)
    assert train(cfg) == 2
    assert "trainer asks for 1 GPU(s) per node from GPU 0 on; this node has 0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written, nothing started


def test_cpu_attention_head_sizes_are_the_installed_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from pipeline.doctor.checks import CPU_ATTENTION_HEAD_SIZES

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_ATTENTION_HEAD_SIZES
