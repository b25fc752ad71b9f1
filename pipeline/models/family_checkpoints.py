"""Small Hugging Face checkpoints of every supported family, built locally for the oracle tests.

Each spec is a non-trivial configuration of its family: grouped-query attention, tied or untied
embeddings, the family's RoPE (llama: ``llama3`` scaling with factors megatron-core does not hard-code),
qwen2's q/k/v biases, qwen3's QK norm and a head_dim that is not hidden/heads, qwen3_moe's routing without
renormalisation.

Invariants:
- Weights are drawn at unit scale from a fixed seed (norm weights 1 +- 0.2, matrices N(0, 1/fan_in),
  biases N(0, 0.1)), so next-token distributions are far from uniform and any conversion or layout bug
  moves the logprobs (a 0.02-std init makes every tiny model nearly uniform).
- The directory holds config.json, model.safetensors (float32), generation_config.json and the tiny
  tokenizer (pipeline.models.tokenizer); transformers, vLLM and the trainer load it as is.
- `build_family_checkpoint(name, out)` is idempotent: an existing complete `out` is returned as is.
"""
from __future__ import annotations

import functools
from pathlib import Path

_COMMON = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=256, max_position_embeddings=1024, rms_norm_eps=1e-6,
               eos_token_id=1, pad_token_id=2, bos_token_id=None, dtype="float32")

#: name -> (transformers config class name, family-specific settings)
FAMILY_SPECS: dict[str, tuple[str, dict]] = {
    "qwen2-tied": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3-tied": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, tie_word_embeddings=False, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False,
                                         decoder_sparse_step=1, mlp_only_layers=[],
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "llama3": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 2.0,
        "high_freq_factor": 8.0, "original_max_position_embeddings": 64})),
    "llama-linear-tied": ("LlamaConfig", dict(num_key_value_heads=1, tie_word_embeddings=True, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
}


def family_config(name: str):
    import transformers

    cls_name, settings = FAMILY_SPECS[name]
    return getattr(transformers, cls_name)(**{**_COMMON, **settings})


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from pipeline.models.tokenizer import train_tokenizer

    return train_tokenizer()


def build_family_checkpoint(name: str, out: str | Path, seed: int = 7) -> Path:
    """Build checkpoint `name` of FAMILY_SPECS into `out` (see the module invariants)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    _tokenizer().save_pretrained(str(out))
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(family_config(name), dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    GenerationConfig(eos_token_id=1, pad_token_id=2).save_pretrained(str(out))
    model.save_pretrained(str(out))
    return out
