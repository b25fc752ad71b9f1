"""The conversion rules between megatron parameters and Hugging Face tensors, and the one adapter
that applies them: HF -> this rank's shard (`shard_of`), shards -> HF (`hf_from_shards`,
`gather_full`) and the HF shapes (`full_hf_shapes`). The trainer's loading and export
(`pipeline.trainer.model`), LoRA (`pipeline.trainer.lora`), checkpoints and the weight sync
(`pipeline.weights.shards`) all convert through here.

Invariants (layouts: `pipeline.trainer.model`'s docstring):
- a `Rule` names one megatron parameter and the HF tensors feeding it; its ``kind`` is "copy"
  (one tensor, split along ``split_dim`` under TP, None: replicated), "qkv" (q, k, v regrouped per
  KV group, split along rows), "glu" (gate and up stacked, each split along rows) or "shared"
  (one replicated tensor stored under every HF name: LoRA's fused A);
- `shard_of` then `hf_from_shards` over every rank's shard is the identity, bit for bit;
- expert rules carry their global expert id and shard over the expert-TP group; the rules of EP
  rank r hold experts ``r * n_local .. r * n_local + n_local - 1``.
- pipeline stage s of pp holds HF layers ``s * L/pp .. (s+1) * L/pp - 1`` as its own
  ``decoder.layers.0 ..``; the embedding only on stage 0, the final norm and the output layer only on
  the last stage (PP2 of 4 layers: stage 1's ``decoder.layers.0`` is ``model.layers.2``); a rank's
  rules are its stage's, so every reader and writer of rules works per stage.

Worked example: 4 query heads, 2 KV heads, head_dim 16, TP 2: the rule of
``decoder.layers.0.self_attention.linear_qkv.weight`` is kind "qkv" over ``q_proj``, ``k_proj``,
``v_proj``; rank r's shard is rows ``[q(2r), q(2r+1), k(r), v(r)]`` (64 rows) and
`full_hf_shapes` of its ``[64, hidden]`` shard gives ``(64, hidden), (32, hidden), (32, hidden)``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .families import has_qk_norm, has_qkv_bias, is_moe

#: Where `pipeline.trainer.lora.attach_lora` keeps its `LoraState` on the unwrapped model.
LORA_ATTRIBUTE = "_tf_lora"


@dataclass(frozen=True)
class Rule:
    """How one megatron parameter is made of HF tensors (see the module docstring)."""

    megatron: str  # megatron parameter name (without a DDP "module." prefix)
    hf: tuple[str, ...]  # HF names feeding it (q,k,v for qkv; gate,up for glu)
    kind: str  # "copy", "qkv", "glu" or "shared" (one replicated tensor stored under every HF name: LoRA's fused A)
    split_dim: int | None  # TP split dimension for "copy" (None: replicated)
    expert: int | None = None  # global expert id for expert weights


def pipeline_stage() -> tuple[int, int]:
    """(this rank's pipeline stage, stages); (0, 1) before megatron's groups exist."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()


def base_rules(hf_config, ep_rank: int, ep_size: int, stage: tuple[int, int] = (0, 1)) -> list[Rule]:
    """Every weight's rule of pipeline ``stage`` = (rank, stages) for EP rank ``ep_rank`` of
    ``ep_size`` (its own experts), in model order; megatron names are the stage's own (module
    docstring)."""
    rank, stages = stage
    per_stage = hf_config.num_hidden_layers // stages
    first = rank * per_stage
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy", 0)] if rank == 0 else []
    for i in range(first, first + per_stage):
        m, h = f"decoder.layers.{i - first}.", f"model.layers.{i}."
        rules += [
            Rule(m + "self_attention.linear_qkv.weight",
                 tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv", 0),
            Rule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "copy", 1),
            Rule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "copy", None),
            Rule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "copy", None),
        ]
        if has_qk_norm(hf_config):
            rules += [
                Rule(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), "copy", None),
                Rule(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), "copy", None),
            ]
        if has_qkv_bias(hf_config):
            rules.append(Rule(m + "self_attention.linear_qkv.bias",
                              tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv", 0))
        if is_moe(hf_config):
            rules.append(Rule(m + "mlp.router.weight", (h + "mlp.gate.weight",), "copy", None))
            n_local = hf_config.num_experts // ep_size
            for j in range(n_local):
                e = ep_rank * n_local + j
                x, he = m + f"mlp.experts.local_experts.{j}.", h + f"mlp.experts.{e}."
                rules += [
                    Rule(x + "linear_fc1.weight", (he + "gate_proj.weight", he + "up_proj.weight"),
                         "glu", 0, e),
                    Rule(x + "linear_fc2.weight", (he + "down_proj.weight",), "copy", 1, e),
                ]
        else:
            rules += [
                Rule(m + "mlp.linear_fc1.weight",
                     (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "glu", 0),
                Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "copy", 1),
            ]
    if rank < stages - 1:
        return rules
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None))
    if not hf_config.tie_word_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "copy", 0))
    return rules


def _qkv_layout(hf_config):
    groups = hf_config.num_key_value_heads
    return groups, hf_config.num_attention_heads // groups


def merge_qkv(hf_config, q, k, v):
    groups, per_group = _qkv_layout(hf_config)
    tail = q.shape[1:]
    q = q.reshape(groups, per_group, -1, *tail)
    k = k.reshape(groups, 1, -1, *tail)
    v = v.reshape(groups, 1, -1, *tail)
    import torch

    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(hf_config, qkv):
    groups, per_group = _qkv_layout(hf_config)
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2, -1, *tail)
    q = grouped[:, :per_group].reshape(-1, *tail)
    k = grouped[:, per_group].reshape(-1, *tail)
    v = grouped[:, per_group + 1].reshape(-1, *tail)
    return q, k, v


def _shard(full, dim, rank, size):
    return full if dim is None or size == 1 else full.chunk(size, dim=dim)[rank]


def tp_group(rule: Rule):
    """(tp-like group, rank, size) that shards this parameter."""
    from megatron.core import parallel_state as ps

    if rule.expert is not None:
        return (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_world_size())
    return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size())


def ep_rank_size(hf_config):
    from megatron.core import parallel_state as ps

    if not is_moe(hf_config):
        return 0, 1
    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def unwrap(model):
    """The GPTModel inside megatron DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def hf_dtype(hf_config):
    """The torch dtype of the model's HF tensors (its config's ``dtype``; float32 when unset)."""
    import torch

    name = getattr(hf_config, "dtype", None)
    if isinstance(name, torch.dtype):
        return name
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(name), torch.float32)


def shard_of(rule: Rule, tensors, hf_config):
    """This rank's megatron shard of ``rule``'s parameter from the full HF ``tensors`` (in
    ``rule.hf`` order); no communication. The inverse of ``gather_full``."""
    import torch

    _, rank, size = tp_group(rule)
    if rule.kind == "shared":
        if any(not torch.equal(tensors[0], t) for t in tensors[1:]):
            raise ValueError(f"{rule.megatron}: {', '.join(rule.hf)} must be equal (one fused adapter)")
        return tensors[0]
    if rule.kind == "qkv":
        return _shard(merge_qkv(hf_config, *tensors), 0, rank, size)
    if rule.kind == "glu":
        return torch.cat([_shard(t, 0, rank, size) for t in tensors], dim=0)
    return _shard(tensors[0], rule.split_dim, rank, size)


def all_gather(tensor, group, size):
    import torch

    if size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(out, tensor.contiguous(), group=group)
    return out


def gather_shards(rule: Rule, value) -> list:
    """Every rank's shard of ``rule``'s parameter, in rank order, from this rank's ``value``: a
    collective over the rule's tensor-parallel group (expert-TP for experts); a "shared" rule's
    value is whole on every rank: ``[value]``, no communication."""
    group, _, size = tp_group(rule)
    return [value] if rule.kind == "shared" else all_gather(value, group, size)


def hf_from_shards(rule: Rule, shards, hf_config) -> tuple:
    """The full HF tensors of ``rule`` (in ``rule.hf`` order) from its shards (`gather_shards`);
    no communication. The inverse of `shard_of`; a "shared" or replicated rule's tensor is
    ``shards[0]`` itself."""
    import torch

    if rule.kind == "shared":
        return (shards[0],) * len(rule.hf)
    if rule.kind == "qkv":
        return split_qkv(hf_config, torch.cat(shards, 0))
    if rule.kind == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)
    return (shards[0] if rule.split_dim is None else torch.cat(shards, rule.split_dim),)


def gather_full(rule: Rule, value, hf_config) -> list:
    """The full HF tensors of ``rule`` (in ``rule.hf`` order) from this rank's shard ``value``:
    a collective over the rule's tensor-parallel group (expert-TP for experts), fresh tensors."""
    shards = gather_shards(rule, value)
    full = hf_from_shards(rule, shards, hf_config)
    return [t.clone() if t is shards[0] else t for t in full]


def rank_shape(rule: Rule, params: dict, tp_size: int, hf_config) -> tuple[int, ...]:
    """A rank's shape of ``rule``'s parameter, from this rank's ``params`` (name -> parameter)
    even when another pipeline stage holds it: every stage holds as many identical layers, so
    another stage's layer has the shape of this stage's layer of the same local name; the
    embedding, final norm and output layer shapes come from the config."""
    if rule.megatron in params:
        return tuple(params[rule.megatron].shape)
    if rule.megatron == "decoder.final_layernorm.weight":
        return (hf_config.hidden_size,)
    if rule.megatron in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (hf_config.vocab_size // tp_size, hf_config.hidden_size)
    raise KeyError(f"{rule.megatron}: no parameter of that name on this pipeline stage")


def full_hf_shapes(rule, local_shape, tp_size: int, hf_config) -> tuple[tuple[int, ...], ...]:
    """Full HF shapes of ``rule``'s tensors from this rank's parameter shape (no communication)."""
    import torch

    dim = 0 if rule.kind in ("qkv", "glu") else rule.split_dim
    full = list(local_shape)
    if dim is not None:
        full[dim] *= tp_size
    if rule.kind == "qkv":
        return tuple(tuple(t.shape) for t in split_qkv(hf_config, torch.empty(full, device="meta")))
    if rule.kind == "glu":
        return ((full[0] // 2, *full[1:]),) * 2
    if rule.kind == "shared":
        return (tuple(full),) * len(rule.hf)
    return (tuple(full),)


def lora_state(model):
    """The model's ``LoraState`` (`pipeline.trainer.lora.attach_lora`; None: full-weight model);
    accepts DDP-wrapped models."""
    return getattr(unwrap(model), LORA_ATTRIBUTE, None)


def adapter_rules(rules: list[Rule], state) -> list[Rule]:
    """Conversion rules of the adapters of ``state.modules`` (a `pipeline.trainer.lora.LoraState`), derived
    from their weights' ``rules``, in that order: HF names are the weight's with ``.weight`` ->
    ``.lora_A.weight`` / ``.lora_B.weight``; a fused (qkv, glu) weight's A is "shared", its B
    split like the weight; a row-parallel weight's A is split like it, its B whole."""
    adapted = set(state.modules)
    out = []
    for rule in rules:
        module, _, leaf = rule.megatron.rpartition(".")
        if leaf != "weight" or module not in adapted:
            continue
        a_names = tuple(h.removesuffix(".weight") + ".lora_A.weight" for h in rule.hf)
        b_names = tuple(h.removesuffix(".weight") + ".lora_B.weight" for h in rule.hf)
        if rule.kind in ("qkv", "glu"):  # column-parallel, fused: shared A, B like the weight
            out += [Rule(module + ".lora_A", a_names, "shared", None, rule.expert),
                    Rule(module + ".lora_B", b_names, rule.kind, 0, rule.expert)]
        elif rule.split_dim == 1:  # row-parallel: A split like the weight, B whole
            out += [Rule(module + ".lora_A", a_names, "copy", 1, rule.expert),
                    Rule(module + ".lora_B", b_names, "copy", None, rule.expert)]
        else:
            raise ValueError(f"{module}: no adapter layout for a {rule.kind!r} rule split on {rule.split_dim}")
    return out


def model_rules(model, hf_config, ep_rank: int, ep_size: int, stage: tuple[int, int] | None = None) -> list[Rule]:
    """The conversion rules of what ``model`` trains for EP rank ``ep_rank`` on pipeline ``stage``
    (None: this rank's): every weight, or only the adapters of a LoRA model (``pipeline.trainer.lora``)."""
    state = lora_state(model)
    base = base_rules(hf_config, ep_rank, ep_size, stage or pipeline_stage())
    return adapter_rules(base, state) if state is not None else base


def conversion_rules(hf_config, model=None) -> list[Rule]:
    """This rank's conversion rules (its EP rank's experts); of ``model``'s trained parameters
    when given (a LoRA model: its adapters)."""
    if model is None:
        return base_rules(hf_config, *ep_rank_size(hf_config), pipeline_stage())
    return model_rules(model, hf_config, *ep_rank_size(hf_config))
