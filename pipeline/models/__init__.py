"""Models without a hub: a locally trained tokenizer and tiny Qwen3 / Qwen3-MoE checkpoints."""
from __future__ import annotations

from pipeline.models.tiny import SUPPORTED_MODEL_TYPES, TinyModelSpec, ensure_tiny_model, resolve_model

__all__ = ["SUPPORTED_MODEL_TYPES", "TinyModelSpec", "ensure_tiny_model", "resolve_model"]
