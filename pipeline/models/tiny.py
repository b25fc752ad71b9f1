"""Tiny Hugging Face checkpoints built locally from a fixed seed (no hub), and model-name resolution.

Invariants:
- `ensure_tiny_model(kind)` returns a directory with config.json, model.safetensors, generation_config.json
  and the tokenizer files (pipeline.models.tokenizer); transformers and vLLM load it as is.
- The directory name is `tiny-<kind>-<key>` where key hashes the TinyModelSpec, the tokenizer's inputs and
  FORMAT_VERSION: a spec change creates a new directory, an unchanged spec reuses the old one.
- The same spec gives bit-identical weights (torch seeded with `spec.seed`, the caller's RNG untouched).
- Creation is atomic and process-safe (pipeline.models.cache.build_once).
- `tiny_config(spec)` is `spec.hf_config()`'s fields (``to_dict()``), computed once per spec and
  transformers version and cached as JSON next to the checkpoints: a process that only reads the
  config (the launcher's checks) does not import transformers, which imports torch (~6 CPU s).

Worked example (defaults): dense = Qwen3ForCausalLM, hidden 256, 2 layers, 4 query heads and 2 KV heads of
head_dim 64, MLP 512, vocab 512 (461 tokenizer entries + unused rows), untied embeddings: 1.44 M parameters.
moe = Qwen3MoeForCausalLM with the same attention and every layer an MoE of 4 experts (MLP 256 each), top-2:
2.23 M parameters.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from pipeline.models.cache import build_once, cache_root
from pipeline.models.tokenizer import IM_END, PAD, builtin_corpus, corpus_digest, save_tokenizer
from pipeline.trainer.families import SUPPORTED_MODEL_TYPES, check_supported

# Bump when the on-disk layout or the build procedure changes (invalidates every cached tiny model).
FORMAT_VERSION = 1

# `model.name`s of the built-in checkpoints (the demo's models; tiny-moe8: 8 experts, top-2, room for
# 2- and 4-way expert parallelism).
TINY_MODELS = ("tiny-dense", "tiny-moe", "tiny-moe8")


@functools.lru_cache(maxsize=None)
def _tokenizer_digest(vocab_size: int) -> str:
    return corpus_digest(builtin_corpus(), vocab_size)


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines a tiny checkpoint."""

    kind: str = "dense"  # "dense" (Qwen3ForCausalLM) or "moe" (Qwen3MoeForCausalLM, every layer MoE)
    hidden_size: int = 256  # model width
    num_layers: int = 2  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    head_dim: int = 64  # per-head width (hidden_size / num_heads for the MoE config)
    intermediate_size: int = 512  # dense MLP width
    moe_intermediate_size: int = 256  # width of each expert's MLP (moe only)
    num_experts: int = 4  # experts per MoE layer (moe only)
    experts_per_token: int = 2  # top-k routing (moe only)
    vocab_size: int = 512  # embedding rows; >= the tokenizer's length
    tokenizer_vocab_size: int = 512  # BPE training target (pipeline.models.tokenizer)
    max_position_embeddings: int = 1024  # longest sequence (RoPE)
    rope_theta: float = 10000.0  # RoPE base
    seed: int = 0  # torch seed of the weight initialisation

    def __post_init__(self):
        if self.kind not in ("dense", "moe"):
            raise ValueError(f"TinyModelSpec.kind must be 'dense' or 'moe', got {self.kind!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.kind == "moe" and self.hidden_size != self.num_heads * self.head_dim:
            raise ValueError("moe: hidden_size must equal num_heads * head_dim (Qwen3-MoE derives head_dim)")
        if self.kind == "moe" and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} not in 1..num_experts={self.num_experts}")

    def key(self) -> str:
        """12 hex digits identifying this spec, its tokenizer and the build format."""
        blob = json.dumps(
            {"spec": asdict(self), "format": FORMAT_VERSION,
             "tokenizer": _tokenizer_digest(self.tokenizer_vocab_size)},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def hf_config(self):
        """The transformers config object (Qwen3Config or Qwen3MoeConfig)."""
        from transformers import Qwen3Config, Qwen3MoeConfig

        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            eos_token_id=1,
            pad_token_id=2,
            bos_token_id=None,
            dtype="float32",
        )
        if self.kind == "dense":
            return Qwen3Config(**common, head_dim=self.head_dim, intermediate_size=self.intermediate_size,
                               architectures=["Qwen3ForCausalLM"])
        return Qwen3MoeConfig(
            **common,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.experts_per_token,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            architectures=["Qwen3MoeForCausalLM"],
        )


class SavedConfig:
    """A transformers config's fields (its ``to_dict()``) read back from JSON: attribute access (an
    absent field raises AttributeError, so ``getattr(config, name, default)`` works) and ``to_dict()``."""

    def __init__(self, fields: dict) -> None:
        self._fields = dict(fields)

    def __getattr__(self, name: str):
        try:
            return self.__dict__["_fields"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict:
        return dict(self._fields)


def tiny_config(spec: TinyModelSpec, root: Path | None = None) -> SavedConfig:
    """`spec.hf_config()`'s fields, built with transformers once per spec (module invariants)."""

    def write(out: Path) -> None:
        (out / "config.json").write_text(spec.hf_config().to_json_string(use_diff=False))

    root = Path(root) if root is not None else default_models_root()
    transformers = metadata.version("transformers")  # its defaults are part of the fields
    saved = build_once(root, f"config-tiny-{spec.kind}-{spec.key()}-transformers-{transformers}", write)
    return SavedConfig(json.loads((saved / "config.json").read_text()))


def default_models_root() -> Path:
    """Where tiny models are cached: `$TOKENFLOW_CACHE/models` or `~/.cache/tokenflow/models`."""
    return cache_root() / "models"


def _build_tiny(spec: TinyModelSpec, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    n_tokens = save_tokenizer(out, spec.tokenizer_vocab_size)
    if n_tokens > spec.vocab_size:
        raise ValueError(f"tokenizer has {n_tokens} entries but TinyModelSpec.vocab_size={spec.vocab_size}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
    model.save_pretrained(str(out))
    GenerationConfig(eos_token_id=1, pad_token_id=2).save_pretrained(str(out))
    (out / "tokenflow_spec.json").write_text(json.dumps({**asdict(spec), "eos": IM_END, "pad": PAD}, indent=1))


def tiny_spec(name: str) -> "TinyModelSpec":
    """The spec of a built-in `model.name` (one of TINY_MODELS)."""
    if name == "tiny-moe8":
        return TinyModelSpec(kind="moe", num_experts=8)
    return TinyModelSpec(kind=name.removeprefix("tiny-"))


def ensure_tiny_model(kind: str = "dense", root: Path | None = None, spec: TinyModelSpec | None = None) -> Path:
    """Path of the cached tiny checkpoint of `kind` ("dense" | "moe"), built on first use.

    `spec` overrides `kind` and every other default (its own `kind` field is used).
    """
    spec = spec if spec is not None else TinyModelSpec(kind=kind)
    root = Path(root) if root is not None else default_models_root()
    return build_once(root, f"tiny-{spec.kind}-{spec.key()}", lambda out: _build_tiny(spec, out))


def resolve_model(name_or_path: str | Path, root: Path | None = None) -> Path:
    """"tiny-dense" / "tiny-moe" / "tiny-moe8" (built on demand) or a Hugging Face checkpoint directory of
    a supported family and options (pipeline.trainer.families.check_supported)."""
    name = str(name_or_path)
    if name in TINY_MODELS:
        return ensure_tiny_model(root=root, spec=tiny_spec(name))
    path = Path(name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name!r} is neither 'tiny-dense', 'tiny-moe' nor an existing checkpoint directory"
        )
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json (not a Hugging Face checkpoint)")
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{config_path}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    from transformers import AutoConfig

    try:
        check_supported(AutoConfig.from_pretrained(str(path)))
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model directory {path} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    return path.resolve()

