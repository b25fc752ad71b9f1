"""The trainer side of a weight sync: each rank's part of the model as a stream of HF-named tensors.

A `ShardedWeights` describes one sync on one trainer rank of any TP x EP (x ETP x DP) layout:
``specs`` is the whole model's plan input (HF name, dtype, full HF shape, sending rank), computed
from the local parameters and the HF config alone, identical on every rank, with no
communication; `tensors()` is the collective that produces, rule by rule, the full tensors this
rank sends. The conversion rules and the gather primitives are the trainer's own
(`pipeline.trainer.model`: ``_rules``, ``_groups``, ``_split_qkv``), so the HF layout is the one
checkpoints and `iter_hf_weights` use.

Invariants:
- Tensors are cast to the model's HF dtype (``config.dtype``) before any gather: a bf16 model
  moves 2 bytes per parameter, not fp32's 4.
- Dense (non-expert) weights are gathered inside each tensor-parallel group of data-parallel rank
  0 only and sent by world rank 0 (sender 0; with PP: each stage's, below). Expert weights are gathered inside each
  expert-tensor-parallel group of expert-data-parallel rank 0 only and sent by that group's ETP
  rank 0: sender ``ep_rank``. No expert crosses an expert-parallel boundary, so no rank ever holds
  experts it does not own, and no rank holds more than one parameter's gather at a time.
- Order (identical on every rank): layer by layer; inside a layer, the dense weights, then the
  experts of EP rank 0, of EP rank 1, ... Every rank's collectives follow this order restricted
  to its groups, and each sender sends its buckets in it, so with at most two buckets in flight
  per sender no wait cycle can form (a sender only waits for receivers, which only wait for
  earlier buckets, whose gathers every rank has passed).
- A LoRA model (``pipeline.trainer.lora``) syncs only its adapters: the same units built from
  its adapter rules (``...q_proj.lora_A.weight``, ...), preceded by one float32 tensor
  ``lora.scaling`` = alpha / r from sender 0; the generator merges them (``adapters.py``).
- Pipeline parallelism: each stage's ranks gather and send their own layers, as above, with
  sender ``stage * ep + ep_rank`` (the dense weights of stage s from sender ``s * ep``); the units
  go stage after stage, so the order is still the model's.
Example: TP2 x EP2 on 4 ranks (megatron order tp-ep-dp: TP/ETP groups {0,1} {2,3}, EP groups
{0,2} {1,3}), 8 experts: senders are rank 0 (dense + experts 0-3) and rank 2 (experts 4-7);
ranks 1 and 3 only take part in their gathers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from pipeline.weights.adapters import SCALING_NAME

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class _Unit:
    """One megatron parameter's worth of HF tensors in the global order."""

    rule: object  # pipeline.trainer.conversion.Rule of the EP rank that owns it
    source: int
    shapes: tuple[tuple[int, ...], ...]


class ShardedWeights:
    """One trainer rank's view of a weight sync (module docstring). Build it on every rank."""

    def __init__(self, model, hf_config):
        import torch
        from megatron.core import parallel_state as ps

        from pipeline.trainer.conversion import (ep_rank_size, hf_dtype, lora_state, model_rules, pipeline_stage,
                                                 tp_group, unwrap)
        from pipeline.weights.bucket_plan import dtype_name

        self.hf_config = hf_config
        self.params = dict(unwrap(model).named_parameters())
        self.dtype = hf_dtype(hf_config)
        ep_rank, ep_size = ep_rank_size(hf_config)
        stage, stages = pipeline_stage()
        self.ep_size = ep_size
        self.slot = stage * ep_size + ep_rank  # this rank's (pipeline stage, EP rank): the source it may be
        expert_sender = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
        world_rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.senders = stages * ep_size
        self.source = self.slot if expert_sender else None
        if (world_rank == 0) != (self.source == 0):
            raise ValueError(f"world rank {world_rank} is{' not' if world_rank == 0 else ''} the sender of "
                             f"expert-parallel rank 0: layouts where rank 0 is not ETP rank 0 of EP rank 0 "
                             f"are not supported")
        dense_sender = ps.get_data_parallel_rank(with_context_parallel=True) == 0 and ps.get_tensor_model_parallel_rank() == 0
        if stages > 1 and dense_sender != (self.source == stage * ep_size):
            raise ValueError(f"world rank {world_rank}: the dense sender of pipeline stage {stage} is not "
                             f"ETP rank 0 of its EP rank 0: this layout is not supported")
        self.gather_dense = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        self.gather_experts = ps.get_expert_data_parallel_rank() == 0
        self.units: list[_Unit] = []
        for s in range(stages):
            per_rank = [model_rules(model, hf_config, r, ep_size, (s, stages)) for r in range(ep_size)]
            i, base = 0, per_rank[0]
            while i < len(base):
                if base[i].expert is None:
                    self.units.append(self._unit(base[i], s * ep_size, tp_group(base[i])[2]))
                    i += 1
                    continue
                j = i
                while j < len(base) and base[j].expert is not None:
                    j += 1
                for r in range(ep_size):
                    self.units += [self._unit(rule, s * ep_size + r, tp_group(rule)[2]) for rule in per_rank[r][i:j]]
                i = j
        name = dtype_name(self.dtype)
        self.specs = [(hf, name, shape, u.source) for u in self.units for hf, shape in zip(u.rule.hf, u.shapes)]
        lora = lora_state(model)
        self.scaling = None if lora is None else lora.scaling
        if lora is not None:  # an adapter update opens with its scale (pipeline/weights/adapters.py)
            self.specs.insert(0, (SCALING_NAME, "float32", (1,), 0))

    @property
    def total_bytes(self) -> int:
        """Bytes of one sync (every sender's tensors, before bucket alignment)."""
        from pipeline.weights.bucket_plan import itemsize

        total = 0
        for _, dtype, shape, _ in self.specs:
            n = itemsize(dtype)
            for d in shape:
                n *= d
            total += n
        return total

    def _unit(self, rule, source: int, tp_size: int) -> _Unit:
        from pipeline.trainer.conversion import full_hf_shapes, rank_shape

        shapes = full_hf_shapes(rule, rank_shape(rule, self.params, tp_size, self.hf_config), tp_size, self.hf_config)
        return _Unit(rule, source, shapes)

    def tensors(self) -> Iterator[tuple[str, "torch.Tensor"]]:
        """Collective over the trainer ranks (every rank exhausts it): gathers this rank's groups'
        parameters in the global order; yields the full HF tensors this rank sends."""
        import torch

        from pipeline.trainer.conversion import gather_shards, hf_from_shards

        if self.scaling is not None and self.source == 0:
            yield SCALING_NAME, torch.tensor([self.scaling], dtype=torch.float32)
        for u in self.units:
            rule = u.rule
            expert = rule.expert is not None
            if u.source // self.ep_size != self.slot // self.ep_size:
                continue  # another pipeline stage's weights: not this rank's collective
            if expert and u.source != self.slot:
                continue  # another EP rank's experts: not this rank's collective
            if not (self.gather_experts if expert else self.gather_dense):
                continue
            value = self.params[rule.megatron].detach().to(self.dtype, copy=True)  # never a live view
            shards = gather_shards(rule, value)
            if self.source != u.source:
                continue
            yield from zip(rule.hf, hf_from_shards(rule, shards, self.hf_config))

