"""The trainer's gradient buffers, optimizer and update: megatron DDP, AdamW or megatron's
distributed optimizer, clipping and the global gradient norm.

Invariants:
- Gradients accumulate in megatron DDP's fp32 buffers (``main_grad``) over the micro-batches of a
  step and are reduced over data parallelism once per step (`finalize_model_grads`), summed
  (``calculate_per_token_loss``): the loss's normaliser makes the sum the mean.
- ``trainer.overlap_grad_reduce`` (default on): each gradient bucket's reduction starts
  asynchronously as soon as the last micro-batch's backward has produced all of its gradients
  (earlier micro-batches run under ``no_sync``), so reductions of late layers run while earlier
  layers still compute their gradients; the step waits for them in ``finish_grad_sync``. The
  values are the same sums as without overlap (one collective per bucket either way).
- ``trainer.overlap_param_gather`` (default off) applies to megatron's distributed optimizer only
  (CUDA): the updated parameter shards are all-gathered bucket by bucket during the next
  step's forward instead of at the end of the optimizer step. Off by default because the weight
  push, exports and checkpoints read the parameters after a step and before the next forward,
  when other ranks' shards would still be stale with data parallelism > 1. The torch optimizer
  (CPU) keeps whole parameters, so there is nothing to gather.
- The global gradient norm counts each distinct parameter element once: TP-sharded parameters on
  every TP rank, replicated ones on TP rank 0; expert parameters over the expert TP x EP group.
"""
from __future__ import annotations


def wrap_ddp(model, cfg, optimizer_kind: str):
    """``model`` in megatron's DistributedDataParallel with the trainer's overlap settings; the
    model's config gets the ``no_sync`` hook megatron's pipeline schedule reads."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    distributed = optimizer_kind == "megatron"
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather and distributed,
        use_distributed_optimizer=distributed)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    if cfg.overlap_grad_reduce:
        model.config.no_sync_func = ddp.no_sync
    return ddp


def make_optimizer(cfg, optimizer_kind: str, model, trainable: list, cuda: bool):
    """(optimizer, fp32 master weights or None) for the trainable parameters of ``model`` (DDP)."""
    import torch

    if not 0.0 <= cfg.optimizer_offload_fraction <= 1.0:
        raise ValueError(f"trainer.optimizer_offload_fraction must be in [0, 1], got {cfg.optimizer_offload_fraction}")
    if cfg.optimizer_offload_fraction and optimizer_kind != "megatron":
        raise ValueError("trainer.optimizer_offload_fraction > 0 needs optimizer='megatron' (CUDA)")
    if optimizer_kind == "torch":  # bf16 parameters: AdamW on fp32 masters (masters.py)
        from .masters import MasterWeights

        masters = MasterWeights(trainable) if cfg.parallel.params_dtype == "bfloat16" else None
        return torch.optim.AdamW(masters.masters if masters else trainable, lr=cfg.lr, betas=cfg.adam_betas,
                                 eps=cfg.adam_eps, weight_decay=cfg.weight_decay), masters
    if optimizer_kind != "megatron":
        raise ValueError(f"optimizer must be 'torch', 'megatron' or 'auto', got {cfg.optimizer!r}")
    if not cuda:
        raise ValueError("optimizer='megatron' needs CUDA (it allocates on device='cuda')")
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_betas[0],
        adam_beta2=cfg.adam_betas[1], adam_eps=cfg.adam_eps, clip_grad=cfg.grad_clip,
        bf16=cfg.parallel.params_dtype == "bfloat16", params_dtype=model.module.config.params_dtype,
        use_distributed_optimizer=True, optimizer_cpu_offload=cfg.optimizer_offload_fraction > 0,
        optimizer_offload_fraction=cfg.optimizer_offload_fraction)
    return get_megatron_optimizer(config, [model]), None


def apply_update(trainer) -> float:
    """Clip and apply the reduced gradients of ``trainer`` (an `Trainer`); the global grad norm."""
    if trainer.optimizer_kind == "megatron":
        _, norm, _ = trainer.optimizer.step()
        return float(norm or 0.0)
    params = trainer.trainable()
    for p in params:
        p.grad = p.main_grad.to(p.dtype)
    norm = grad_norm(trainer)
    scale = 1.0
    if trainer.cfg.grad_clip and norm > trainer.cfg.grad_clip:
        scale = trainer.cfg.grad_clip / (norm + 1e-6)
        for p in params:
            p.grad.mul_(scale)
    if trainer.masters is not None:
        trainer.masters.step(trainer.optimizer, scale)
    else:
        trainer.optimizer.step()
    return norm


def grad_norm(trainer) -> float:
    """Global L2 norm of ``trainer``'s gradient: each distinct parameter element counted once."""
    from megatron.core import parallel_state as ps

    dense, expert = 0.0, 0.0
    tp_rank = ps.get_tensor_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    for p in trainer.trainable():
        sq = float(p.main_grad.double().pow(2).sum())
        is_sharded = getattr(p, "tensor_model_parallel", False)
        if not getattr(p, "allreduce", True):  # expert parameter: distinct per EP rank
            expert += sq if (is_sharded or etp_rank == 0) else 0.0
        else:
            dense += sq if (is_sharded or tp_rank == 0) else 0.0
    dense = float(trainer._all_reduce([dense], trainer.tp_group)[0])
    if trainer.model.module.config.num_moe_experts:
        expert = float(trainer._all_reduce([expert], ps.get_expert_tensor_and_model_parallel_group())[0])
    if trainer.stages is not None:  # each stage holds its own layers
        return float(trainer._all_reduce([dense + expert], trainer.stages.group)[0]) ** 0.5
    return (dense + expert) ** 0.5
