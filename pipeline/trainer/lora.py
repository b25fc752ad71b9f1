"""LoRA in the megatron-core trainer: low-rank adapters around its linear layers, base frozen.

An adapted linear layer computes ``y = W x + s * B (A x)`` with ``s = alpha / r``, ``A: [r, in]``,
``B: [out, r]``; ``W`` is frozen (``requires_grad=False``, so megatron DDP and the optimizer never
see it and no optimizer state exists for it). The adapters are parameters ``lora_A`` / ``lora_B``
registered on the adapted megatron module itself (``...linear_qkv.lora_A``), applied by a forward
hook, so the base parameters keep their names and their HF conversion rules.

Invariants:
- Fused layers carry ONE adapter, as megatron fuses them: ``linear_qkv`` (q, k, v) and
  ``linear_fc1`` (gate, up; per expert too) have one ``A`` shared by the fused parts and one ``B``
  whose rows are laid out like the fused weight's. In Hugging Face / PEFT terms that is
  ``q_proj.lora_A = k_proj.lora_A = v_proj.lora_A`` and ``B`` split like the weight (QKV
  regrouping, gate/up halves). Example, 4 query heads, 2 KV heads, head_dim 64, hidden 256, r 8:
  ``linear_qkv.lora_B`` is ``[512, 8]`` (rows ``[q(g,0), q(g,1), k(g), v(g)]`` per group g),
  HF ``q_proj.lora_B`` ``[256, 8]``, ``k_proj.lora_B`` and ``v_proj.lora_B`` ``[128, 8]``, all
  three ``lora_A`` the same ``[8, 256]``.
- Tensor parallelism: a column-parallel layer (qkv, fc1) keeps ``A`` whole (replicated) and ``B``
  split along its output rows like ``W``; a row-parallel layer (proj, fc2) splits ``A`` along its
  input columns like ``W`` and keeps ``B`` whole. The communication mirrors megatron's: column:
  ``B_r * copy_to_tp(A * gather_seq(x))`` (the backward all-reduce makes ``A``'s gradient whole
  and equal on every TP rank); row: ``scatter_seq(B * reduce_from_tp(A_r x_r))``.
- Expert parallelism: an expert's adapters are parameters of that expert's module
  (``local_experts.J``), so they live on the EP rank that owns the expert, are marked
  ``allreduce=False`` (megatron reduces them over the expert-data-parallel group) and receive
  gradients only from the tokens routed to that expert. Expert adapters need expert-TP 1.
- Conversion rules (``adapter_rules``, `pipeline.trainer.conversion`) are derived from the base
  weight's rule: HF names are the weight's with ``.weight`` -> ``.lora_A.weight`` /
  ``.lora_B.weight``, and checkpoints, weight sync and exports reuse the base machinery with them
  (``pipeline.trainer.conversion.model_rules``).
- Initialisation is layout-independent: each full HF-shaped adapter tensor is drawn from its own
  generator, seeded by ``seed`` and its HF name (``A`` uniform in ``+-1/sqrt(in)``, PEFT's default;
  ``B = 0``, so the adapted model starts equal to the base), and cut for each rank by the same
  rules as loading. Expert E's adapters are therefore the same whichever EP rank holds E and
  whatever else is adapted (a draw order over the rules would differ between EP sizes: each EP
  rank's rule list interleaves the dense layers with its own experts only).
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import LoraConfig, ParallelConfig
from .conversion import (LORA_ATTRIBUTE, adapter_rules, base_rules, conversion_rules, ep_rank_size, full_hf_shapes,
                         lora_state, pipeline_stage, rank_shape, tp_group, unwrap)
from .families import is_moe

if TYPE_CHECKING:
    import torch

#: Megatron module names (last component) that can carry an adapter, with their TP kind.
ADAPTABLE = {"linear_qkv": "column", "linear_proj": "row", "linear_fc1": "column", "linear_fc2": "row"}
ADAPTER_PARAMS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class LoraState:
    """What ``attach_lora`` did to a model (kept on the unwrapped model as ``LORA_ATTRIBUTE``)."""

    cfg: LoraConfig
    modules: tuple[str, ...]  # adapted megatron module names (identical on every EP rank)

    @property
    def scaling(self) -> float:
        return self.cfg.alpha / self.cfg.rank


def check_lora_config(cfg: LoraConfig, parallel: ParallelConfig) -> None:
    """Refuse settings LoRA cannot honour (before any model is built), naming the field."""
    if cfg.rank < 0:
        raise ValueError(f"trainer.lora.rank must be >= 0, got {cfg.rank}")
    if not cfg.rank:
        return
    if cfg.alpha <= 0:
        raise ValueError(f"trainer.lora.alpha must be > 0, got {cfg.alpha}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"trainer.lora.dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.dropout and parallel.tp > 1:
        raise ValueError("trainer.lora.dropout > 0 with trainer.parallel.tp > 1 is not supported "
                         "(the replicated adapter input would get different masks per TP rank)")
    if not cfg.targets:
        raise ValueError("trainer.lora.targets is empty: name at least one module pattern")
    for pattern in cfg.targets:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"trainer.lora.targets: {pattern!r} is not a regular expression ({e})") from None


def adaptable_modules(model) -> dict[str, object]:
    """``{megatron module name: module}`` of the linear layers an adapter can wrap."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return {name: mod for name, mod in model.named_modules()
            if name.rsplit(".", 1)[-1] in ADAPTABLE and isinstance(mod, (ColumnParallelLinear, RowParallelLinear))}


def select_targets(names, cfg: LoraConfig) -> list[str]:
    """The adaptable module names matched by ``cfg.targets``; a pattern matching none is refused."""
    names = list(names)
    chosen = set()
    for pattern in cfg.targets:
        hits = [n for n in names if re.search(pattern, n)]
        if not hits:
            kinds = sorted({re.sub(r"\.\d+\.", ".N.", n) for n in names})
            raise ValueError(f"trainer.lora.targets pattern {pattern!r} matches no adaptable module; "
                             f"adaptable: {', '.join(kinds)}")
        chosen.update(hits)
    return [n for n in names if n in chosen]


def _is_expert(name: str) -> bool:
    return ".local_experts." in name


def attach_lora(model, cfg: LoraConfig, parallel: ParallelConfig, hf_config, seed: int) -> LoraState:
    """Freeze ``model`` (an unwrapped GPTModel with its base weights loaded) and add adapters to
    the modules ``cfg.targets`` select; returns the ``LoraState`` also stored on the model."""
    import torch
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    check_lora_config(cfg, parallel)
    candidates = adaptable_modules(model)
    targets = select_targets(candidates, cfg)
    if is_moe(hf_config) and parallel.expert_tp > 1 and any(_is_expert(n) for n in targets):
        raise ValueError(f"LoRA on experts needs expert tensor parallelism 1 (trainer.parallel.etp="
                         f"{parallel.expert_tp}); set trainer.parallel.etp=1 or leave experts out of "
                         f"trainer.lora.targets")
    model.requires_grad_(False)
    dtype = model.config.params_dtype
    for name in targets:
        mod = candidates[name]
        kind = ADAPTABLE[name.rsplit(".", 1)[-1]]
        weight = mod.weight
        out_local, in_local = weight.shape
        a = torch.nn.Parameter(torch.zeros(cfg.rank, in_local, dtype=dtype, device=weight.device))
        b = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, dtype=dtype, device=weight.device))
        sharded = a if kind == "row" else b
        if getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(sharded, True, 1 if kind == "row" else 0, 1)
        if _is_expert(name):
            a.allreduce = b.allreduce = False
        mod.register_parameter("lora_A", a)
        mod.register_parameter("lora_B", b)
        mod._tf_lora_kind = kind
        mod.register_forward_hook(_adapter_hook)
    state = LoraState(cfg, tuple(targets))
    setattr(model, LORA_ATTRIBUTE, state)
    for mod in (candidates[n] for n in targets):
        mod._tf_lora_scaling, mod._tf_lora_dropout = state.scaling, cfg.dropout
    init_adapters(model, hf_config, seed)
    return state


def _adapter_hook(module, args, output):
    """Forward hook of an adapted layer: adds ``s * B (A x)`` to megatron's ``(output, bias)``."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import mappings as mp

    x = args[0]
    if module._tf_lora_dropout and module.training:
        x = F.dropout(x, module._tf_lora_dropout)
    explicit = getattr(module, "explicit_expert_comm", False)  # experts: the dispatcher communicates
    sp = getattr(module, "sequence_parallel", False) and not explicit
    group = module.tp_group
    if module._tf_lora_kind == "column":
        if sp:
            x = mp.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)
        h = F.linear(x, module.lora_A)
        if not explicit:
            h = mp.copy_to_tensor_model_parallel_region(h, group=group)
        delta = F.linear(h, module.lora_B)
    else:
        h = F.linear(x, module.lora_A)
        if not explicit:
            h = mp.reduce_from_tensor_model_parallel_region(h, group=group)
        delta = F.linear(h, module.lora_B)
        if sp:
            delta = mp.scatter_to_sequence_parallel_region(delta, group=group)
    out, bias = output
    return out + module._tf_lora_scaling * delta, bias


def _adapter_generator(seed: int, hf_name: str) -> "torch.Generator":
    """The random stream of one adapter tensor: a function of ``seed`` and its HF name only."""
    import torch

    return torch.Generator().manual_seed((seed * 2**32 + zlib.crc32(hf_name.encode())) % 2**63)


def init_adapters(model, hf_config, seed: int, b_std: float = 0.0) -> None:
    """Set this rank's adapters to their layout-independent initial value (module docstring);
    ``b_std`` > 0 draws ``B`` from N(0, b_std) instead of zeros (tests use it to get a
    non-trivial adapter). Each rank draws only the full tensors of its own rules."""
    import torch

    from .model import iter_megatron_shards

    params = dict(model.named_parameters())
    full = {}
    for rule in conversion_rules(hf_config, model):  # this rank's adapters (its EP rank's experts)
        shapes = full_hf_shapes(rule, tuple(params[rule.megatron].shape), tp_group(rule)[2], hf_config)
        if rule.megatron.endswith("lora_A"):  # one draw, stored under every name of a fused A
            bound = 1.0 / shapes[0][1] ** 0.5
            gen = _adapter_generator(seed, rule.hf[0])
            t = torch.empty(shapes[0]).uniform_(-bound, bound, generator=gen)
            values = [t] * len(shapes) if rule.kind == "shared" else [t]
        else:
            values = [torch.randn(s, generator=_adapter_generator(seed, n)) * b_std
                      for n, s in zip(rule.hf, shapes)]
        full.update(zip(rule.hf, values))
    with torch.no_grad():
        for name, shard in iter_megatron_shards(model, hf_config, full.__getitem__):
            params[name].copy_(shard.to(params[name].dtype))


def trainable_parameters(model, hf_config) -> int:
    """Number of distinct trainable elements of the whole model (all ranks; no communication)."""
    model = unwrap(model)
    params = dict(model.named_parameters())
    state = lora_state(model)
    _, ep_size = ep_rank_size(hf_config)
    stages = pipeline_stage()[1]
    total = 0
    for r, stage in ((r, s) for s in range(stages) for r in range(ep_size)):
        rules = base_rules(hf_config, r, ep_size, (stage, stages))
        for rule in adapter_rules(rules, state) if state else rules:
            if r and rule.expert is None:
                continue  # dense rules: counted once
            size = tp_group(rule)[2]
            shapes = full_hf_shapes(rule, rank_shape(rule, params, size, hf_config), size, hf_config)
            count = [1] * len(shapes)
            for i, s in enumerate(shapes):
                for d in s:
                    count[i] *= d
            total += count[0] if rule.kind == "shared" else sum(count)
    return total
