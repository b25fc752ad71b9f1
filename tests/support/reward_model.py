"""A tiny reward model for tests and benchmarks of the scorer roles (`pipeline.scorers.models`).

Invariant: the same arguments give the same weights, bit for bit (its own seed; the global torch
RNG is left as it was).
"""
from __future__ import annotations

from pathlib import Path


def build_tiny_reward_model(out: str | Path, vocab_size: int = 1024, hidden_size: int = 64,
                            num_layers: int = 2, pad_token_id: int = 0, seed: int = 0) -> Path:
    """A tiny randomly initialised Qwen3ForSequenceClassification (one label) saved to ``out``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden_size // 4, max_position_embeddings=2048, num_labels=1,
                      pad_token_id=pad_token_id, tie_word_embeddings=False)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen3ForSequenceClassification(cfg)
        with torch.no_grad():  # a score head of visible scale (its default init is ~0.02 wide)
            model.score.weight.normal_(0.0, 1.0 / hidden_size ** 0.5)
    finally:
        torch.random.set_rng_state(state)
    out = Path(out)
    model.save_pretrained(out)
    return out
