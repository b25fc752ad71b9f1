"""The planner's arithmetic (pipeline.plan) against independent references: parameter counts of the
transformers models built from the same configs (on the meta device), the per-rank division of
megatron's layouts, the refusal and the search; `tokenflow plan` as a command."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.plan.memory import GiB, Layout, rank_memory
from pipeline.plan.search import USABLE, fitting, refusal
from pipeline.plan.shape import ModelShape

REPO = Path(__file__).resolve().parents[2]
QWEN3_30B = REPO / "configs" / "models" / "qwen3-30b-a3b.json"


def hf_param_count(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tiny_models_parameter_count_equals_transformers(kind):
    from pipeline.models.tiny import TinyModelSpec

    config = TinyModelSpec(kind=kind).hf_config()
    assert ModelShape.from_config(config.to_dict()).n_params == hf_param_count(config)


def test_qwen3_30b_a3b_shape_from_its_config_json():
    from transformers import AutoConfig

    shape = ModelShape.from_file(QWEN3_30B)
    assert shape.is_moe and (shape.experts, shape.top_k, shape.layers) == (128, 8, 48)
    assert shape.n_params == hf_param_count(AutoConfig.for_model(**json.loads(QWEN3_30B.read_text())))
    assert 30.0e9 < shape.n_params < 31.0e9  # the published "30.5B total"


def test_a_missing_config_field_is_named():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_config({"model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2})


def test_expert_state_divides_by_ep_and_expert_dp_dense_by_tp_and_dp():
    shape = ModelShape.from_file(QWEN3_30B)
    experts = shape.layers * shape.n_expert_layer
    one = rank_memory(shape, Layout(world=8, ep=8, micro_batch_tokens=1024, seq_len=1024))
    two = rank_memory(shape, Layout(world=8, ep=4, micro_batch_tokens=1024, seq_len=1024))
    # bf16 parameters: 2 bytes; ep 4 holds twice the experts of ep 8
    assert two.components["parameters"] - one.components["parameters"] == pytest.approx(2 * experts / 8)
    # distributed optimizer: fp32 masters + two moments (12 B) over expert-DP 1 (ep 8) or 2 (ep 4)
    assert Layout(world=8, ep=4).expert_dp == 2 and Layout(world=8, ep=8).expert_dp == 1
    dense = shape.n_params - experts
    assert one.components["optimizer"] == pytest.approx(12 * (dense / 8 + experts / 8))
    assert two.components["optimizer"] == pytest.approx(12 * (dense / 8 + experts / 4 / 2))
    half = rank_memory(shape, Layout(world=8, ep=8, offload=0.5, micro_batch_tokens=1024, seq_len=1024))
    assert half.components["optimizer"] == pytest.approx(one.components["optimizer"] / 2)


def test_recompute_logit_chunks_and_cp_shrink_what_they_should():
    shape = ModelShape.from_file(QWEN3_30B)
    base = Layout(world=8, ep=8, micro_batch_tokens=8192, seq_len=8192, attention="local")
    plain = rank_memory(shape, base)
    full = rank_memory(shape, Layout(**{**base.__dict__, "recompute": "full"}))
    small_chunks = rank_memory(shape, Layout(**{**base.__dict__, "logits_chunk": 256}))
    cp2 = rank_memory(shape, Layout(**{**base.__dict__, "cp": 2, "attention": "flash"}))
    flash = rank_memory(shape, Layout(**{**base.__dict__, "attention": "flash"}))
    assert full.components["activations"] < plain.components["activations"] / 10
    # one chunk's fp32 logits, softmax/gradient (8 B) and kept-set mask (1 B) per vocabulary entry
    assert plain.components["logits"] == pytest.approx(9 * 1024 * shape.vocab)
    assert small_chunks.components["logits"] == pytest.approx(plain.components["logits"] * 256 / 1024)
    # CP halves every per-token part but the attention kernel's (K/V gathered whole, rank 0's query
    # block spans the row: twice per local token, plus the gathered K/V); the stacked expert weights
    # (bf16, 48 saved + one gradient) stay
    stacked = 2 * shape.n_expert_layer / 8 * (48 + 1)
    q, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    kernel = (2 * q + kv) * d + q * 4 / 2
    grown = 2 * shape.layers * 8192 * (kernel + 4 * kv * d)  # bf16 bytes: 2 x (2 (kernel + 2 kv d) - kernel) x 4096 tokens
    assert 2 * cp2.components["activations"] - flash.components["activations"] == pytest.approx(stacked + grown)
    assert cp2.kv_gather == pytest.approx(8192 / 2 * 2 * kv * d * 2) and flash.kv_gather == 0
    assert flash.components["attention"] == 0 and plain.components["attention"] > 0


def test_pipeline_stages_bubble_and_first_stage_holds_most_in_flight():
    shape = ModelShape.from_file(QWEN3_30B)
    plan = rank_memory(shape, Layout(world=8, pp=4, ep=2, micro_batches=12, micro_batch_tokens=4096,
                                     seq_len=4096, attention="flash"))
    assert plan.bubble == pytest.approx(3 / 15)
    assert plan.stage == 0  # 1F1B: stage 0 holds pp micro-batches' activations


def test_refusal_names_what_binds_and_the_search_only_returns_fitting_layouts():
    shape = ModelShape.from_file(QWEN3_30B)
    plan = rank_memory(shape, Layout(world=8, ep=8, micro_batch_tokens=8192, seq_len=8192))
    why = refusal(plan, 80 * GiB)
    assert why is not None and "activations binds" in why and "exceeds 72.0 GiB" in why
    plans = fitting(shape, Layout(world=8, micro_batch_tokens=32768, seq_len=32768), 80 * GiB)
    assert plans and all(p.peak <= USABLE * 80 * GiB for p in plans)
    assert refusal(plans[0], 80 * GiB) is None
    with pytest.raises(ValueError, match="experts do not split"):
        rank_memory(shape, Layout(world=6, ep=3))


def test_tokenflow_plan_command_recommends_and_refuses():
    def plan(*args):
        return subprocess.run([sys.executable, "-m", "pipeline.cli", "plan", "--model", "qwen3-30b-a3b",
                               "--gpus", "8", "--gpu-memory", "80GB", "--json", *args],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
    ok = plan("--tokens", "8192")
    assert ok.returncode == 0, ok.stderr
    best = json.loads(ok.stdout.splitlines()[-1])["layouts"][0]
    assert best["peak_gib"] <= 72.0
    dense_tp2 = subprocess.run([sys.executable, "-m", "pipeline.cli", "plan", "--model", "tiny-dense", "--gpus", "2",
                                "--tp", "2", "--tokens", "512", "--json"], capture_output=True, text=True,
                               timeout=120, cwd=REPO)
    assert dense_tp2.returncode == 0 and json.loads(dense_tp2.stdout)["fits"], dense_tp2.stderr
    refused = plan("--tokens", "8192", "--ep", "8")
    assert refused.returncode == 2
    assert "activations binds" in json.loads(refused.stdout)["refusal"]
