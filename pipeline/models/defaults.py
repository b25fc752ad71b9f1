"""Run settings that depend on the model and the task, resolved before anything starts.

Config fields left None ("auto") are filled here, in the launching process, by `pipeline.config.validate`;
the run directory's config.yaml then stores the resolved values, so every role (and a resume) uses them.

Rules (a field the user set is kept; each rule reads only the model's config and the task):
- the model must be a supported family with supported options (pipeline.trainer.families): an
  unsupported checkpoint is refused here, naming the config field, before any process starts;
- model.warmstart_steps: the task's for the built-in tiny models (sort, the demo: 300; dataset 0; others
  120), 0 for a checkpoint;
- generator.max_tokens: the task's completion budget (task.max_tokens; built-in sort/addition 32, dataset 1024);
- generator.max_num_seqs: 64 for the tiny models, 256 for a checkpoint;
- generator.enforce_eager: on for the tiny models (start-up dominates a 2-minute demo), off for a checkpoint
  (vLLM captures CUDA graphs on GPU, compiles on CPU);
- generator.max_model_len: min(the model's max_position_embeddings, task.max_prompt_tokens + max_tokens);
- generator.dtype 'auto': the checkpoint's dtype (its config's ``dtype``/``torch_dtype``; float32 when it
  names none), written out so vLLM gets it explicitly: vLLM's own 'auto' runs a float32 checkpoint in
  bfloat16 (every platform), and the trainer (float32 parameters by default) would score the
  generator's tokens at another precision;
- generator.kv_cache_gib (CPU): the KV cache of max_num_seqs full-length sequences at the engine's dtype
  (the resolved generator.dtype), rounded up to GiB, at most half of one generator's share of
  cluster.generator.mem_gb (vLLM then decodes fewer sequences at once), at least 1;
- the checkpoint's generation_config.json: its EOS ids are used by vLLM itself (they end completions);
  its sampling suggestions (temperature, top_p, top_k) are reported, not adopted: the loss needs samples
  from the policy's full distribution at trainer.temperature (set generator.temperature and
  trainer.temperature together to change it);
- task.epochs, when set, must cover run.steps x orchestrator.groups_per_step prompts;
- task.max_tokens and task.max_prompt_tokens, both left unset while the task's own budgets (dataset:
  1024 + 1024) exceed the model's positions: a quarter of the positions for the completion, the rest
  for the prompt (the tiny models' 1024 positions: 256 + 768).

Worked example: tiny-moe on the sort task: warm-start 300 steps, max_tokens 32, max_num_seqs 64, eager,
dtype float32 (the checkpoint's), max_model_len min(1024, 32 + 32) = 64, KV cache 2 layers x 2 KV heads
x 64 dims x 2 (K, V) x 4 bytes = 2 KiB per token x 64 x 64 = 8 MiB -> 1 GiB. A Qwen3 checkpoint (40960
positions, bfloat16) on a dataset task: no warm-start, max_tokens 1024, 256 sequences, CUDA graphs, dtype
bfloat16, max_model_len 2048.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from pipeline.models.tiny import TINY_MODELS, tiny_config, tiny_spec

log = logging.getLogger(__name__)

TINY_GENERATOR = {"max_num_seqs": 64, "enforce_eager": True}
CHECKPOINT_GENERATOR = {"max_num_seqs": 256, "enforce_eager": False}
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def model_config(name: str):
    """The transformers config of `model.name` (a tiny model's fields without building it or
    importing transformers: pipeline.models.tiny.tiny_config); refuses an unsupported family or option."""
    if name in TINY_MODELS:
        return tiny_config(tiny_spec(name))
    from pipeline.models.tiny import resolve_model
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(resolve_model(name)))


def checkpoint_dtype(hf_config) -> str:
    """The dtype the checkpoint's config names ('float32' when it names none)."""
    named = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    return str(named).removeprefix("torch.")


def kv_bytes_per_token(hf_config, dtype: str) -> int:
    """Bytes of K and V one token occupies in all layers, the engine running in `dtype` (a name
    vLLM accepts; 'auto' is the checkpoint's, see `checkpoint_dtype`)."""
    from pipeline.trainer.families import head_dim

    dtype = checkpoint_dtype(hf_config) if dtype == "auto" else dtype
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"generator.dtype={dtype!r}: expected auto or one of {sorted(_DTYPE_BYTES)}")
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim(hf_config) * \
        _DTYPE_BYTES[dtype]


def _report_generation_config(name: str, cfg) -> None:
    path = Path(name) / "generation_config.json"
    if name in TINY_MODELS or not path.is_file():
        return
    suggested = {k: v for k, v in json.loads(path.read_text()).items() if k in ("temperature", "top_p", "top_k")}
    ours = {"temperature": cfg.generator.temperature, "top_p": cfg.generator.top_p, "top_k": cfg.generator.top_k}
    differing = {k: v for k, v in suggested.items() if ours.get(k) != v}
    if differing:
        log.warning("%s suggests sampling with %s; RL samples the policy with %s (see pipeline.models.defaults)",
                    path, differing, ours)


def resolve_defaults(cfg) -> None:
    """Fill cfg's None fields from the model and the task (see the module rules); idempotent."""
    from pipeline.tasks import make_task

    # The task's data first: a bad row is reported in seconds, before the model's libraries load.
    task = make_task(cfg.task) if cfg.task.name != "synthetic" else None
    tiny = cfg.model.name in TINY_MODELS
    hf = model_config(cfg.model.name)
    cfg.model.warmstart_steps = cfg.model.warmstart_steps_or_default(task)
    g = cfg.generator
    if g.dtype == "auto":
        g.dtype = checkpoint_dtype(hf)
    for key, value in (TINY_GENERATOR if tiny else CHECKPOINT_GENERATOR).items():
        if getattr(g, key) is None:
            setattr(g, key, value)
    if task is not None:
        positions = int(hf.max_position_embeddings)
        if (cfg.task.max_tokens is None and cfg.task.max_prompt_tokens is None
                and task.max_tokens + task.max_prompt_tokens > positions):
            cfg.task.max_tokens = positions // 4
            cfg.task.max_prompt_tokens = positions - cfg.task.max_tokens
        cfg.task.max_tokens = cfg.task.max_tokens or task.max_tokens
        cfg.task.max_prompt_tokens = cfg.task.max_prompt_tokens or task.max_prompt_tokens
        if cfg.task.epochs is not None:
            needed = cfg.run.steps * cfg.orchestrator.groups_per_step
            if cfg.task.epochs < 1 or needed > cfg.task.epochs * task.train_size:
                raise ValueError(f"task.epochs={cfg.task.epochs} gives {cfg.task.epochs} x {task.train_size} "
                                 f"training prompts; run.steps x orchestrator.groups_per_step needs {needed}")
    if g.max_tokens is None:
        g.max_tokens = cfg.task.max_tokens or 1024
    if g.max_model_len is None:
        prompt = cfg.task.max_prompt_tokens or 1024
        g.max_model_len = min(int(hf.max_position_embeddings), prompt + g.max_tokens)
    if g.max_model_len <= g.max_tokens:
        raise ValueError(f"generator.max_model_len ({g.max_model_len}) must exceed generator.max_tokens "
                         f"({g.max_tokens}); the model allows {hf.max_position_embeddings} positions")
    if g.kv_cache_gib is None:
        need = kv_bytes_per_token(hf, g.dtype) * g.max_model_len * g.max_num_seqs
        spec = cfg.cluster.generator
        room = int(spec.mem_gb / max(1, spec.tasks_per_node) / 2)  # half of one generator's memory
        g.kv_cache_gib = max(1, min(math.ceil(need / 2**30), room))
    _report_generation_config(cfg.model.name, cfg)
