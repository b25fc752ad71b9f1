"""Build a megatron-core GPTModel from a Hugging Face config; convert weights both ways.

Invariants:
- Supported HF families and options: pipeline.trainer.families (``check_supported``); anything else
  raises ``ValueError`` naming the config field. RoPE inverse frequencies come from the config
  (``families.rope_inv_freq``: default, linear, llama3 with any parameters).
- The megatron model computes the same function as the HF model (dropout off, no fusions, local
  layer spec on CPU and GPU; float32 logprobs agree with transformers to ~2e-6 on CPU).
- Expert parallelism: ``tp`` x ``ep`` x ``etp`` as megatron-core defines them; ``etp`` defaults to
  1 with ``ep > 1`` and to ``tp`` otherwise (``ParallelConfig.expert_tp``); with ``ep == 1`` it must equal ``tp`` (megatron-core 0.16.1 would otherwise reduce
  expert gradients over the wrong group). The ``allgather`` MoE dispatcher is refused with
  ``tp * ep > 1`` (it needs equal micro-batch shapes on every rank).
- The HF side is always the on-disk / on-the-wire layout: per-expert names
  (``model.layers.L.mlp.experts.E.gate_proj.weight``), ``[out, in]`` matrices, HF shapes.
- Megatron side (local spec): ``linear_qkv`` rows are grouped per KV group:
  ``[q(g,0..q_per_group-1), k(g), v(g)]`` for g = 0..groups-1, each ``head_dim`` rows; ``linear_fc1``
  rows are ``[gate; up]``; under TP each rank holds ``[gate_r; up_r]`` and a contiguous block of
  KV groups. Example: 4 query heads, 2 KV heads, head_dim 16, TP 2 -> rank r holds group r:
  rows ``[q(2r), q(2r+1), k(r), v(r)]`` = 64 rows.
- Experts: EP rank r holds global experts ``r*n_local .. r*n_local+n_local-1`` as
  ``local_experts.j``; expert TP (ETP) shards them like the dense MLP. With
  ``trainer.parallel.grouped_experts`` they run as grouped products (`GroupedExperts`, same parameters).
- HF -> megatron -> HF is the identity, bit for bit (tested).
- Pipeline parallelism (``parallel.pp``): a rank builds its stage only (`build_gpt_model`); layer
  names and which weights a stage holds: `pipeline.trainer.conversion`. ``pp`` must divide the
  layers; tied embeddings and context parallelism inside a pipeline are refused
  (`check_pipeline_layout`). Context parallelism (``parallel.cp``) shards no parameter: every
  rank of a CP group holds the same weights (`pipeline.trainer.context_parallel`).
- ``iter_hf_weights`` (refused under PP) is a collective: every rank must exhaust it; only world rank 0 receives
  items (fresh full HF tensors, never views of live parameters, gathered over TP, ETP and EP).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

from .config import MoEConfig, ParallelConfig
from .conversion import all_gather, ep_rank_size, gather_full, lora_state, model_rules, pipeline_stage, shard_of, unwrap
from .families import check_supported, has_qk_norm, has_qkv_bias, is_moe, rope_inv_freq, rope_parameters


#: ``trainer.recompute`` -> megatron ``TransformerConfig`` recomputation fields.
RECOMPUTE = {"none": {},
             "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
             "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}


def load_hf_config(model_dir: str | Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    try:
        check_supported(config)
    except ValueError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    return config


def uses_sequence_parallel(hf_config, parallel: ParallelConfig) -> bool:
    """Sequence parallelism in effect: as configured, else on for an MoE model with TP > 1
    (megatron-core requires it there)."""
    if parallel.sequence_parallel is not None:
        return bool(parallel.sequence_parallel)
    return is_moe(hf_config) and parallel.tp > 1


def transformer_config(hf_config, parallel: ParallelConfig, moe_cfg: MoEConfig | None = None,
                       recompute: str = "none"):
    """The megatron ``TransformerConfig`` equivalent to ``hf_config`` (dropout off, no fusions);
    ``recompute`` (``trainer.recompute``) as megatron's activation recomputation: "selective"
    recomputes core attention in backward, "full" every layer (uniform, one layer per unit)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    if recompute not in RECOMPUTE:
        raise ValueError(f"trainer.recompute must be one of {sorted(RECOMPUTE)}, got {recompute!r}")
    if hf_config.vocab_size % parallel.tp:
        raise ValueError(f"vocab_size {hf_config.vocab_size} is not divisible by tp={parallel.tp}")
    check_pipeline_layout(hf_config, parallel)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[parallel.params_dtype]
    moe = is_moe(hf_config)
    etp = parallel.expert_tp
    sequence_parallel = uses_sequence_parallel(hf_config, parallel)
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        qk_layernorm=has_qk_norm(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        variable_seq_lengths=parallel.pp > 1,  # micro-batches differ in shape: stages exchange them
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        calculate_per_token_loss=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **RECOMPUTE[recompute],
    )
    if moe:
        moe_cfg = moe_cfg or MoEConfig()
        if moe_cfg.load_balancing not in ("none", "aux_loss", "seq_aux_loss", "global_aux_loss"):
            raise ValueError(f"trainer.moe.load_balancing must be none, aux_loss, seq_aux_loss or "
                             f"global_aux_loss, got {moe_cfg.load_balancing!r}")
        if moe_cfg.aux_loss_coef and moe_cfg.load_balancing == "none":
            raise ValueError("trainer.moe.aux_loss_coef > 0 needs trainer.moe.load_balancing != 'none'")
        if moe_cfg.drop_policy not in ("probs", "position"):
            raise ValueError(f"trainer.moe.drop_policy must be probs or position, got {moe_cfg.drop_policy!r}")
        if parallel.moe_dispatcher != "alltoall" and parallel.ep * parallel.tp > 1:
            raise ValueError(
                f"moe_dispatcher={parallel.moe_dispatcher!r} with tp*ep > 1 needs identical "
                "micro-batch shapes on every expert-parallel rank, which per-rank batches do not "
                "have; use 'alltoall'")
        if parallel.ep == 1 and etp != parallel.tp:
            # megatron-core 0.16.1 marks expert weights as expert-parallel only when ep > 1; with
            # ep == 1 their gradients are reduced over the dense DP group, which misses the
            # tensor-parallel ranks that saw other tokens when etp < tp.
            raise ValueError(f"etp={etp} != tp={parallel.tp} needs ep > 1")
        kwargs.update(
            num_moe_experts=hf_config.num_experts,
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            # HF: softmax over all experts, top-k, renormalise only if norm_topk_prob.
            # megatron: pre_softmax -> softmax then top-k (no renormalisation);
            #           otherwise top-k then softmax over the k (= renormalised).
            moe_router_pre_softmax=not hf_config.norm_topk_prob,
            moe_router_load_balancing_type=moe_cfg.load_balancing,
            moe_aux_loss_coeff=moe_cfg.aux_loss_coef,
            moe_z_loss_coeff=moe_cfg.z_loss_coef or None,
            moe_expert_capacity_factor=moe_cfg.capacity_factor,
            moe_token_drop_policy=moe_cfg.drop_policy,
            moe_token_dispatcher_type=parallel.moe_dispatcher,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=etp,
        )
    elif parallel.ep != 1 or etp != parallel.tp:
        raise ValueError(f"ep={parallel.ep}, etp={parallel.etp} given for dense model "
                         f"{hf_config.model_type}; expert parallelism needs an MoE model")
    return TransformerConfig(**kwargs)


def check_pipeline_layout(hf_config, parallel: ParallelConfig) -> None:
    """Refuse pipeline / context-parallel layouts this trainer cannot build, naming the setting."""
    if parallel.cp < 1:
        raise ValueError(f"trainer.parallel.cp={parallel.cp} must be >= 1")
    if parallel.cp > 1 and parallel.pp > 1:
        raise ValueError(f"trainer.parallel.cp={parallel.cp} with pp={parallel.pp}: context parallelism "
                         "inside a pipeline is not built (use cp or pp)")
    if parallel.pp < 1 or hf_config.num_hidden_layers % parallel.pp:
        raise ValueError(f"trainer.parallel.pp={parallel.pp} must divide the model's "
                         f"{hf_config.num_hidden_layers} layers (every stage holds as many)")
    if parallel.pp > 1 and hf_config.tie_word_embeddings:
        raise ValueError("trainer.parallel.pp > 1 with tied embeddings (tie_word_embeddings) is not "
                         "supported: the output layer would be a second copy on the last stage")


def layer_spec(num_experts: int | None, qk_layernorm: bool, grouped_experts: bool = False):
    """The layer spec every trainer model is built with: megatron's local spec with RMSNorm; with
    ``grouped_experts`` an MoE layer's experts are `GroupedExperts` (same parameters)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=qk_layernorm, normalization="RMSNorm")
    if num_experts and grouped_experts:
        from .grouped_experts import GroupedExperts

        spec.submodules.mlp.submodules.experts.module = GroupedExperts
    return spec


def spec_norm(hf_config) -> str:
    """Class name of the norm `layer_spec` gives ``hf_config``'s layers (selects megatron_patches)."""
    spec = layer_spec(None, has_qk_norm(hf_config))
    return spec.submodules.input_layernorm.__name__


def build_gpt_model(hf_config, parallel: ParallelConfig, moe_cfg: MoEConfig | None = None,
                    recompute: str = "none"):
    """A randomly initialised megatron ``GPTModel`` matching ``hf_config`` (load weights after)."""
    from megatron.core.models.gpt import GPTModel

    from megatron.core import parallel_state as ps

    config = transformer_config(hf_config, parallel, moe_cfg, recompute)
    spec = layer_spec(config.num_moe_experts, config.qk_layernorm, parallel.grouped_experts)
    model = GPTModel(  # a pipeline stage: embedding on the first, norm + output layer on the last
        config=config, transformer_layer_spec=spec, vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope", rotary_base=float(rope_parameters(hf_config)["rope_theta"]),
        rotary_percent=1.0)
    rotary = model.rotary_pos_emb  # megatron's llama3 scaling has fixed factors: use the config's own
    rotary.inv_freq = rope_inv_freq(hf_config).to(rotary.inv_freq.device)
    if not config.use_cpu_initialization:
        model.cuda()
    return model


def iter_megatron_shards(model, hf_config, read) -> Iterator[tuple[str, "torch.Tensor"]]:
    """``(megatron name, this rank's shard)`` for every trained parameter of ``model`` (all of
    them, or a LoRA model's adapters), cut from full HF tensors that ``read(hf_name)`` returns;
    checks shapes and that every such parameter is covered."""

    params = dict(unwrap(model).named_parameters())
    ep_rank, ep_size = ep_rank_size(hf_config)
    expected = {n for n in params if lora_state(model) is None or n.rpartition(".")[2] in ("lora_A", "lora_B")}
    for rule in model_rules(model, hf_config, ep_rank, ep_size):
        shard = shard_of(rule, [read(n) for n in rule.hf], hf_config)
        shape = tuple(params[rule.megatron].shape)
        if tuple(shard.shape) != shape:
            raise ValueError(f"{rule.megatron}: shard shape {tuple(shard.shape)} from HF does not "
                             f"match the model's {shape}")
        expected.discard(rule.megatron)
        yield rule.megatron, shard
    if expected:
        raise KeyError(f"megatron parameters without an HF source: {sorted(expected)}")


def hf_tensor_reader(files, what: str):
    """``read(hf_name)`` over safetensors ``files`` (opened lazily, one tensor read per call);
    a missing name raises KeyError naming ``what``."""
    from safetensors import safe_open

    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {what}")
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}

    def read(name):
        if name not in where:
            raise KeyError(f"{what} lacks tensor {name!r}")
        return where[name].get_tensor(name)
    return read


def load_hf_weights(model, hf_config, model_dir: str | Path) -> None:
    """Copy this rank's shard of every weight from the HF safetensors in ``model_dir``."""
    import torch

    params = dict(unwrap(model).named_parameters())
    read = hf_tensor_reader(sorted(Path(model_dir).glob("*.safetensors")), str(model_dir))
    with torch.no_grad():
        for name, shard in iter_megatron_shards(model, hf_config, read):
            params[name].copy_(shard.to(params[name].dtype))


def iter_hf_weights(model, hf_config, grads: bool = False) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Yield ``(hf_name, full tensor)`` on world rank 0; a collective every rank must exhaust.

    With ``grads=True`` yields gradients (``param.main_grad`` under megatron DDP, else
    ``param.grad``) in the same layout, which tests use to compare parallel layouts.
    """
    import torch

    if pipeline_stage()[1] > 1:
        raise ValueError("iter_hf_weights gathers on world rank 0, which holds one pipeline stage only: "
                         "with trainer.parallel.pp > 1 use hf_shards.write_tensor_set")
    model = unwrap(model)
    params = dict(model.named_parameters())
    ep_rank, ep_size = ep_rank_size(hf_config)
    is_root = torch.distributed.get_rank() == 0
    from megatron.core import parallel_state as ps

    ep_group = ps.get_expert_model_parallel_group() if ep_size > 1 else None
    for rule in model_rules(model, hf_config, ep_rank, ep_size):
        param = params[rule.megatron]
        value = param
        if grads:
            value = getattr(param, "main_grad", None)
            if value is None:
                value = param.grad if param.grad is not None else torch.zeros_like(param)
        value = value.detach().to(torch.float32, copy=True)  # never a view of live memory
        full = gather_full(rule, value, hf_config)
        if rule.expert is not None and ep_size > 1:
            per_rank = [all_gather(t, ep_group, ep_size) for t in full]
            n_local = hf_config.num_experts // ep_size
            local = rule.expert - ep_rank * n_local
            for r in range(ep_size):
                names = [re.sub(r"experts\.\d+\.", f"experts.{r * n_local + local}.", n)
                         for n in rule.hf]
                if is_root:
                    yield from zip(names, [t[r] for t in per_rank])
        elif is_root:
            yield from zip(rule.hf, full)
