"""MoE training controls and visibility: router-loss/capacity config reaching megatron-core, patch
selection by device and layout, routing statistics against transformers' router, token drops."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trainer import launch  # noqa: E402


def test_gpu_moe_tp2_gets_the_sequence_parallel_norm_patch():
    """Which patches a GPU trainer would get, decided on this CPU machine."""
    from megatron_patches import select_patches

    from pipeline.trainer.config import ParallelConfig
    from pipeline.trainer.model import uses_sequence_parallel

    class MoE:  # the field uses_sequence_parallel reads
        model_type = "qwen3_moe"

    class Dense:
        model_type = "qwen3"

    gpu_moe_tp2 = select_patches("cuda", uses_sequence_parallel(MoE, ParallelConfig(tp=2, ep=2)))
    assert gpu_moe_tp2 == ["moe_te_general_gemm", "varlen_attention", "torch_norm_sequence_parallel"]
    assert select_patches("cuda", uses_sequence_parallel(Dense, ParallelConfig(tp=2))) == [
        "moe_te_general_gemm", "varlen_attention"]
    assert "torch_norm_sequence_parallel" not in select_patches("cuda", True, norm="FusedLayerNorm")
    cpu = select_patches("cpu", uses_sequence_parallel(MoE, ParallelConfig(tp=2)))
    assert {"cuda_rng", "gloo_uneven_gather_scatter", "torch_norm_sequence_parallel"} <= set(cpu)
    with pytest.raises(ValueError, match="device"):
        select_patches("tpu", False)


def test_each_generator_and_trainer_rank_gets_its_own_gpus():
    """Plan level: two generators (TP 2) and four trainer ranks per 4-GPU node."""
    from pipeline.launch.plan import ComponentSpec, JobPlan, LaunchError

    trainer = ComponentSpec(entry="pipeline.roles.trainer:main", nodes=2, tasks_per_node=4, gpus_per_node=4)
    generator = ComponentSpec(entry="pipeline.roles.generator:main", nodes=1, tasks_per_node=2, gpus_per_node=4)
    JobPlan(components={"trainer": trainer, "generator": generator}).validate()
    from pipeline.launch.gpus import local_gpus, slurm_gpus, task_gpu_env

    node = [str(i) for i in range(4)]
    assert [local_gpus(trainer, r, node) for r in range(8)] == [["0"], ["1"], ["2"], ["3"]] * 2
    assert [local_gpus(generator, r, node) for r in range(2)] == [["0", "1"], ["2", "3"]]
    bound = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "SLURM_LOCALID": "1"}  # Slurm's binding
    assert slurm_gpus(generator, bound) == ["6", "7"]
    plan = JobPlan(components={"scorer": ComponentSpec(entry="a.b:c")})
    assert task_gpu_env(plan, "scorer", 0, {}) == {"CUDA_VISIBLE_DEVICES": "", "LOCAL_RANK": "0"}
    bad = ComponentSpec(entry="pipeline.roles.generator:main", tasks_per_node=3, gpus_per_node=4)
    with pytest.raises(LaunchError, match="multiple of tasks_per_node"):
        JobPlan(components={"generator": bad}).validate()


def test_moe_config_fields_reach_megatron(tmp_path):
    from pipeline.models.tiny import resolve_model
    from pipeline.trainer.config import MoEConfig, ParallelConfig
    from pipeline.trainer.model import load_hf_config, transformer_config

    hf = load_hf_config(resolve_model("tiny-moe8"))
    default = transformer_config(hf, ParallelConfig())
    assert default.moe_router_load_balancing_type == "none" and default.moe_expert_capacity_factor is None
    assert default.num_moe_experts == 8
    c = transformer_config(hf, ParallelConfig(), MoEConfig(load_balancing="seq_aux_loss", aux_loss_coef=1e-2,
                                                           z_loss_coef=1e-3, capacity_factor=1.25,
                                                           drop_policy="position"))
    assert (c.moe_router_load_balancing_type, c.moe_aux_loss_coeff, c.moe_z_loss_coeff) == ("seq_aux_loss", 1e-2, 1e-3)
    assert (c.moe_expert_capacity_factor, c.moe_token_drop_policy) == (1.25, "position")
    with pytest.raises(ValueError, match="load_balancing"):
        transformer_config(hf, ParallelConfig(), MoEConfig(load_balancing="sinkhorn2"))
    with pytest.raises(ValueError, match="aux_loss_coef"):
        transformer_config(hf, ParallelConfig(), MoEConfig(aux_loss_coef=0.1))


def test_expert_tp_is_one_with_expert_parallelism_and_the_planner_searches_what_the_trainer_builds():
    from pipeline.plan.memory import Layout
    from pipeline.plan.search import candidates
    from pipeline.plan.shape import ModelShape
    from pipeline.models.tiny import resolve_model
    from pipeline.trainer.config import ParallelConfig
    from pipeline.trainer.model import load_hf_config, transformer_config

    assert [ParallelConfig(tp=t, ep=e).expert_tp for t, e in ((2, 2), (1, 2), (2, 1), (4, 1))] == [1, 1, 2, 4]
    assert ParallelConfig(tp=2, ep=2, etp=2).expert_tp == 2
    hf = load_hf_config(resolve_model("tiny-moe8"))
    assert transformer_config(hf, ParallelConfig(tp=2, ep=2)).expert_tensor_parallel_size == 1
    with pytest.raises(ValueError, match="needs ep > 1"):
        transformer_config(hf, ParallelConfig(tp=2, etp=1))
    shape = ModelShape.from_config(hf.to_dict())
    for layout in candidates(shape, Layout(world=8, micro_batch_tokens=512, seq_len=512)):
        assert layout.etp == ParallelConfig(tp=layout.tp, ep=layout.ep).expert_tp, layout


def test_export_names_what_is_missing(tmp_path, capsys):
    from pipeline.apps.export import main

    run = tmp_path / "run"
    (run / "checkpoints" / "step-4").mkdir(parents=True)  # no trainer.json: incomplete
    assert main([str(run), "--step", "4"]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint" in err and "step-4" in err


def scenario_routing(outdir: Path, args: dict) -> None:
    from pipeline.trainer.config import MoEConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer
    from support.oracle import make_samples

    trainer = Trainer(TrainerConfig(model_dir=args["model_dir"], moe=MoEConfig(**args["moe"]),
                                    micro_batch_tokens=64, lr=1e-4))
    samples = make_samples(4, 12, trainer.hf_config.vocab_size)
    metrics = trainer.train_step(samples)
    (outdir / "result.json").write_text(json.dumps(metrics))
    trainer.close()


def _hf_expert_counts(model_dir, samples, layers, experts):
    """Top-k assignments per layer and expert from transformers' own router."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    counts = np.zeros((layers, experts))

    def hook(layer):
        def count(module, inputs, output):
            counts[layer] += np.bincount(output[2].reshape(-1).numpy(), minlength=experts)
        return count
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(hook(i))
    with torch.no_grad():
        for s in samples:
            model(torch.from_numpy(np.concatenate([s.prompt_ids, s.completion_ids])[:-1])[None])
    return counts


@pytest.mark.engine
def test_routing_statistics_match_transformers_router_and_capacity_drops(tmp_path):
    from support.oracle import make_samples, sharpened_checkpoint

    model_dir = sharpened_checkpoint("moe8", tmp_path / "model")
    launch("routing", 1, tmp_path / "free", {"model_dir": str(model_dir), "moe": {}}, script=Path(__file__))
    launch("routing", 1, tmp_path / "capped", {"model_dir": str(model_dir), "moe": {"capacity_factor": 0.5}},
           script=Path(__file__))
    free = json.loads((tmp_path / "free" / "result.json").read_text())
    capped = json.loads((tmp_path / "capped" / "result.json").read_text())
    samples = make_samples(4, 12, 512)
    ref = _hf_expert_counts(model_dir, samples, 2, 8)
    ref_load = ref / ref.sum(1, keepdims=True)
    got = np.array([[free[f"moe_load_l{l}_e{e}"] for e in range(8)] for l in range(2)])
    err = float(np.abs(got - ref_load).max())
    print(f"\nexpert load vs transformers' router: max err {err:.1e}; imbalance "
          f"{free['moe_imbalance_l0']:.2f}/{free['moe_imbalance_l1']:.2f}; capacity 0.5 dropped "
          f"{capped['moe_dropped']:.0f} of {2 * ref.sum(1)[0]:.0f} assignments")
    assert err < 1e-9, "megatron's routing statistics differ from transformers' top-k choices"
    assert free["moe_dropped"] == 0.0
    assert free["moe_imbalance_max"] == pytest.approx(float((ref_load.max(1) * 8).max()))
    # capacity 0.5: each expert keeps at most half its even share of a micro-batch's assignments
    assert 0 < capped["moe_dropped"] < ref.sum(), "capacity 0.5 must drop some, not all, assignments"


if __name__ == "__main__":
    {"routing": scenario_routing}[sys.argv[1]](Path(sys.argv[2]), json.loads(sys.argv[3]))


def test_sequence_parallel_norm_patch_applies_with_an_unrelated_apex_installed(tmp_path):
    """PyPI's `apex` (unrelated to NVIDIA's) or NGC's Apex on the path: the local spec still builds
    its RMSNorm as WrappedTorchNorm, so the sequence-parallel norm patch must still apply (the old
    selection skipped it whenever `find_spec("apex")` found anything, and the norm asserted)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("")  # what `pip install apex` (PyPI) gives: a package named apex
    code = (
        "from megatron_patches import apply_patches\n"
        "apply_patches('cpu', sequence_parallel=True)\n"
        "from megatron.core.transformer.torch_norm import WrappedTorchNorm\n"
        "from megatron.core.transformer.transformer_config import TransformerConfig\n"
        "cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,\n"
        "                        sequence_parallel=True, normalization='RMSNorm', use_cpu_initialization=True)\n"
        "norm = WrappedTorchNorm(config=cfg, hidden_size=8)\n"
        "print(norm.weight.sequence_parallel)\n"
        "from megatron_patches import TORCH_NORM\n"
        "from pipeline.models.defaults import model_config\n"
        "from pipeline.trainer.model import spec_norm\n"
        "print(spec_norm(model_config('tiny-moe')) == TORCH_NORM)\n")
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}:{repo}", "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True"]
