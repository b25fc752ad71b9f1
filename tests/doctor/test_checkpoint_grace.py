"""The doctor's checkpoint-grace check (`pipeline.doctor.checkpoint_grace`): the size estimate
against transformers' own parameter count, the write probe on this machine's disk, and the
refusal of a configuration whose grace cannot cover a save (a 30B-shaped MoE: 366 GB)."""
from __future__ import annotations

import re

import pytest

from pipeline.config import TokenflowConfig
from pipeline.doctor.checkpoint_grace import assess_grace, checkpoint_size, graces, parameter_count, write_bandwidth
from pipeline.doctor.registry import Run


def _configs():
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    from pipeline.models.tiny import tiny_spec

    return {
        "qwen3-30b-a3b": Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                                         num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                         num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
        "qwen2-tied": Qwen2Config(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True),
        "llama-head32": LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=128, head_dim=32),
        "tiny-moe": tiny_spec("tiny-moe").hf_config(), "tiny-dense": tiny_spec("tiny-dense").hf_config()}


def _hf_count(hf) -> tuple[int, int]:
    """(all, expert) parameters of the transformers model itself (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    named = list(model.named_parameters())
    return sum(p.numel() for _, p in named), sum(p.numel() for n, p in named if ".experts." in n)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen2-tied", "llama-head32", "tiny-moe", "tiny-dense"])
def test_parameter_count_equals_transformers(name):
    hf = _configs()[name]
    dense, expert = parameter_count(hf)
    assert (dense + expert, expert) == _hf_count(hf)
    if name.startswith("tiny-"):  # the launcher's checks read a tiny model's fields without transformers
        from pipeline.models.defaults import model_config

        assert parameter_count(model_config(name)) == (dense, expert)


def _run(tmp_path, **run_fields) -> Run:
    from pipeline.apps.train import job_plan

    cfg = TokenflowConfig()
    cfg.run.dir = str(tmp_path / "run")
    for key, value in run_fields.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section) if section != "lora" else cfg.trainer.lora, field, value)
    return Run(cfg, job_plan(cfg, tmp_path / "run"))


def test_size_is_weights_and_two_moments_in_float32_with_experts_over_ep(tmp_path):
    hf = _configs()["qwen3-30b-a3b"]
    total, expert = _hf_count(hf)
    run = _run(tmp_path)
    run.cfg.trainer.parallel.ep = 8
    size = checkpoint_size(run.cfg, hf)
    assert size.params == total and size.total_bytes == 12 * total
    assert size.largest_rank_bytes == 12 * (total - expert + expert // 8)
    run.cfg.trainer.lora.rank = 8  # the adapters only: far smaller, still counted
    assert 0 < checkpoint_size(run.cfg, hf).total_bytes < size.total_bytes / 50


def test_probe_measures_the_directory_and_leaves_nothing(tmp_path):
    assert write_bandwidth(tmp_path) > 0
    assert list(tmp_path.iterdir()) == []


def test_a_save_longer_than_the_grace_is_refused_naming_the_numbers(tmp_path):
    hf = _configs()["qwen3-30b-a3b"]
    run = _run(tmp_path)
    assess_grace(run, hf)
    assert len(run.refusals) == 1, [f.text for f in run.findings]
    text = run.refusals[0].text
    needed, gb, grace = re.search(r"needs (\d+) s \(([\d.]+) GB at .* gives (\d+) s", text).groups()
    assert float(gb) == pytest.approx(12 * _hf_count(hf)[0] / 1e9, rel=1e-2)
    assert int(needed) > int(grace) == 60 and "cluster.stop_grace_s" in text
    small = _run(tmp_path, lora__rank=8)  # the same model training LoRA adapters: its save fits
    assess_grace(small, hf)
    assert small.refusals == [] and any("needed at a stop" in f.text for f in small.findings)


@pytest.mark.slurm
def test_slurm_graces_are_the_stop_grace_and_each_preemptible_partitions_grace_time(tmp_path):
    run = _run(tmp_path, cluster__launcher="slurm")
    for spec in run.plan.components.values():
        spec.partition = "preemptible"  # the test cluster: PreemptMode REQUEUE, GraceTime 60
    run.plan.stop_grace_s = 45.0
    found = graces(run)
    assert found["cluster.stop_grace_s (checkpoint signal to requeue)"] == 45.0
    assert found["GraceTime of partition preemptible (preemption, trainer)"] == 60.0
    run.plan.components["trainer"].partition = "debug"  # never preempted: no GraceTime applies
    assert not any("partition debug" in k for k in graces(run))
