"""Which Hugging Face model families the trainer and generators support, and their family-specific parts.

Invariants:
- `check_supported(hf_config)` accepts exactly what the HF <-> megatron mapping (pipeline.trainer.model)
  reproduces, and raises ValueError naming the offending config field otherwise. It runs in the
  launching process (pipeline.models.defaults) so an unsupported checkpoint is refused before anything
  starts. Supported: ``qwen2`` (q/k/v bias, no sliding window), ``qwen3`` and ``qwen3_moe`` (QK norm;
  qwen3_moe with every layer MoE), ``llama`` (no attention/MLP bias); SiLU-gated MLPs, RMSNorm, tied or
  untied embeddings, grouped-query attention, any head_dim.
- RoPE: ``default``, ``linear`` and ``llama3`` with any parameters. megatron-core 0.16.1's own llama3
  scaling hard-codes low/high frequency factors 1 and 4 and an original context of 8192, so it is never
  used: `rope_inv_freq` computes the inverse frequencies from the config's own values and the trainer
  installs them in the model's rotary embedding. Other RoPE types (yarn, dynamic, longrope, ...) and a
  partial rotary factor are refused by name.

Worked example (llama3; head_dim 4, theta 10000, factor 8, low 1, high 4, original context 8192): the
default inverse frequencies are [1, 0.01]; their wavelengths 2*pi*[1, 100] = [6.3, 628] are shorter than
8192 / 4 = 2048 (high-frequency band), so both stay unchanged; with original context 256 instead, 628 is
longer than 256 / 1 = 256 (low-frequency band) and becomes 0.01 / 8 = 0.00125.
"""
from __future__ import annotations

import math

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama")
ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config) -> dict:
    """The config's RoPE parameters (transformers 5 normalises legacy ``rope_scaling`` into these)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def check_supported(hf_config) -> None:
    """Refuse a config the trainer cannot reproduce exactly (see the module invariants)."""
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    refusals = [
        (getattr(hf_config, "hidden_act", "silu") != "silu",
         f"hidden_act={getattr(hf_config, 'hidden_act', None)!r} (only 'silu' is supported)"),
        (model_type != "qwen2" and bool(getattr(hf_config, "attention_bias", False)),
         "attention_bias=true (an o_proj bias has no megatron counterpart here)"),
        (bool(getattr(hf_config, "mlp_bias", False)), "mlp_bias=true (MLP biases are not supported)"),
        (bool(getattr(hf_config, "use_sliding_window", False)),
         "use_sliding_window=true (sliding-window attention is not supported)"),
        (model_type == "qwen3_moe" and (bool(getattr(hf_config, "mlp_only_layers", None))
                                        or getattr(hf_config, "decoder_sparse_step", 1) != 1),
         "mlp_only_layers / decoder_sparse_step (qwen3_moe with dense layers is not supported)"),
    ]
    params = rope_parameters(hf_config)
    refusals += [
        (params["rope_type"] not in ROPE_TYPES,
         f"rope_parameters.rope_type={params['rope_type']!r} (supported: {', '.join(ROPE_TYPES)})"),
        (float(params.get("partial_rotary_factor", 1.0)) != 1.0,
         f"rope_parameters.partial_rotary_factor={params.get('partial_rotary_factor')} (only 1.0)"),
    ]
    for refused, what in refusals:
        if refused:
            raise ValueError(f"{model_type} checkpoint with {what}")


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def rope_inv_freq(hf_config):
    """float32 inverse frequencies [head_dim / 2] of the config's RoPE (default, linear or llama3)."""
    import torch

    params = rope_parameters(hf_config)
    dim = head_dim(hf_config)
    inv = 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    kind = params["rope_type"]
    if kind == "linear":
        inv = inv / float(params["factor"])
    elif kind == "llama3":
        factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
        context = float(params.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
        wavelen = 2 * math.pi / inv
        smooth = (context / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > context / low, inv / factor, torch.where(wavelen < context / high, inv, mid))
    elif kind != "default":
        raise ValueError(f"rope_parameters.rope_type={kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return inv


def has_qk_norm(hf_config) -> bool:
    return hf_config.model_type in ("qwen3", "qwen3_moe")


def has_qkv_bias(hf_config) -> bool:
    return hf_config.model_type == "qwen2"


def is_moe(hf_config) -> bool:
    return hf_config.model_type == "qwen3_moe"
