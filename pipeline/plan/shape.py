"""A model's shape as the memory planner needs it, read from a Hugging Face ``config.json``.

No torch, no transformers: a ``config.json`` alone is enough (a 30B model can be planned on a laptop).
The families are the trainer's (qwen2, qwen3, llama dense; qwen3_moe with every layer MoE and no
shared expert): gated MLPs, RMSNorm, grouped-query attention, optional QK norm and QKV bias.

Parameter counts (``n_*``) are whole-model, unsharded:

- attention per layer: ``h*(q + 2*kv)*d`` (QKV) + ``q*d*h`` (output) + QKV bias + QK norms;
- dense MLP per layer: ``3*h*f``; MoE per layer: router ``E*h`` (dense: replicated like attention)
  + ``E * 3*h*f_e`` experts;
- norms ``2*h`` per layer + the final ``h``; embedding ``V*h`` and output ``V*h`` (once if tied).

Worked example (configs/models/qwen3-30b-a3b.json: h 2048, 48 layers, 32 query / 4 KV heads of
128, 128 experts of 768, top 8, V 151936, untied): attention 2048*(32+8)*128 + 32*128*2048 =
18.9 M per layer; experts 128*3*2048*768 = 604 M per layer; in all 30.5 B parameters, of which
29.0 B are experts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MOE_TYPES = ("qwen3_moe", "qwen2_moe")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that set a model's memory."""

    layers: int  # decoder layers
    hidden: int  # model width h
    heads: int  # query heads q
    kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # per-head width d
    ffn: int  # dense MLP width f (unused when every layer is MoE)
    vocab: int  # embedding rows V
    experts: int = 0  # experts per MoE layer (0: dense)
    top_k: int = 0  # experts each token is routed to
    expert_ffn: int = 0  # width of one expert's MLP
    tied: bool = False  # input and output embeddings shared
    qkv_bias: bool = False  # q/k/v projections carry biases (qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (qwen3)

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        """From a ``config.json``'s dict; a missing field raises ValueError naming it."""
        def need(key):
            if key not in config:
                raise ValueError(f"model config lacks {key!r} (model_type {config.get('model_type')!r})")
            return config[key]

        heads = need("num_attention_heads")
        experts = config.get("num_experts", config.get("num_local_experts")) or 0  # transformers 5 writes num_local_experts
        moe = config.get("model_type") in MOE_TYPES and experts > 0
        return cls(
            layers=need("num_hidden_layers"), hidden=need("hidden_size"), heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or need("hidden_size") // heads,
            ffn=need("intermediate_size"), vocab=need("vocab_size"),
            experts=experts if moe else 0,
            top_k=need("num_experts_per_tok") if moe else 0,
            expert_ffn=need("moe_intermediate_size") if moe else 0,
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=config.get("model_type", "").startswith("qwen2"),
            qk_norm=config.get("model_type", "").startswith("qwen3"))

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelShape":
        """From a ``config.json`` file or a directory holding one."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no model config at {path}")
        try:
            return cls.from_config(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def n_attention(self) -> int:
        """Attention parameters of one layer (QKV, output, biases, QK norms)."""
        q, kv, d, h = self.heads, self.kv_heads, self.head_dim, self.hidden
        return h * (q + 2 * kv) * d + q * d * h + (q + 2 * kv) * d * self.qkv_bias + 2 * d * self.qk_norm

    @property
    def n_dense_mlp(self) -> int:
        """Dense MLP parameters of one layer (0 for an MoE layer)."""
        return 0 if self.is_moe else 3 * self.hidden * self.ffn

    @property
    def n_router(self) -> int:
        return self.experts * self.hidden

    @property
    def n_expert_layer(self) -> int:
        """All experts of one MoE layer."""
        return self.experts * 3 * self.hidden * self.expert_ffn

    @property
    def n_embedding(self) -> int:
        """Input embedding plus output layer (once if tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def n_params(self) -> int:
        per_layer = self.n_attention + self.n_dense_mlp + self.n_router + self.n_expert_layer + 2 * self.hidden
        return self.layers * per_layer + self.hidden + self.n_embedding
