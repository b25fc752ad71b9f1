"""The doctor's ``memory`` check: the trainer's planned per-rank peak against the memory it gets.

The layout is the config's (`trainer.parallel`, ``micro_batch_tokens`` in rows of
``generator.max_model_len`` tokens (one row when it is unset or longer), parameter
dtype, optimizer and its offload, the KL reference model, ``trainer.recompute``) on the trainer's
ranks, as the trainer runs: log-probabilities in chunks of ``trainer.logprob_chunk_tokens``; both
layouts' per-sequence attention holds no ``S x S`` tensor (`pipeline.plan.memory`, attention "flash").
The memory of a rank: each GPU's (nvidia-smi) when the trainer has GPUs, else this host's memory
shared by the trainer ranks. A peak above `pipeline.plan.search.USABLE` of it is refused, naming
what binds.
"""
from __future__ import annotations

import os

from pipeline.doctor.checks import smallest_gpu_figure
from pipeline.doctor.registry import Run, check


def _gpu_memory_bytes() -> float | None:
    """The smallest GPU's memory on this node (nvidia-smi's MiB), None when there is none."""
    mib = smallest_gpu_figure("memory.total")
    return None if mib is None else mib * 1024 ** 2


@check("memory")
def memory(run: Run) -> None:
    from pipeline.models.defaults import model_config
    from pipeline.plan.memory import GiB, Layout, rank_memory
    from pipeline.plan.search import refusal
    from pipeline.plan.shape import ModelShape

    cfg, spec = run.cfg, run.plan.components["trainer"]
    t, p = cfg.trainer, cfg.trainer.parallel
    gpu = spec.gpus_per_node > 0
    shape = ModelShape.from_config(model_config(cfg.model.name).to_dict())
    layout = Layout(world=spec.num_tasks, tp=p.tp, ep=p.ep, etp=p.expert_tp, pp=p.pp, cp=p.cp,
                    micro_batch_tokens=t.micro_batch_tokens,
                    seq_len=min(t.micro_batch_tokens, cfg.generator.max_model_len or t.micro_batch_tokens),
                    params_dtype=p.params_dtype,
                    optimizer=t.optimizer if t.optimizer != "auto" else ("megatron" if gpu else "torch"),
                    offload=t.optimizer_offload_fraction, reference=t.loss.kl_coef > 0, recompute=t.recompute,
                    logits_chunk=t.logprob_chunk_tokens, attention="flash")
    try:
        plan = rank_memory(shape, layout)
    except ValueError as exc:
        run.refuse(f"trainer layout: {exc}")
        return
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.components.items() if v)
    if gpu:
        capacity, where = _gpu_memory_bytes(), "GPU"
    else:
        ranks_here = spec.num_tasks if cfg.cluster.launcher == "local" else spec.tasks_per_node
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, ranks_here)
        where = f"host memory / {ranks_here} rank(s)"
    run.uses(f"trainer rank peak {plan.peak / GiB:.2f} GiB at {t.micro_batch_tokens} tokens per "
             f"micro-batch in rows of {layout.seq_len} (GiB: {parts}; expert-DP {layout.expert_dp}; `tokenflow plan` for other layouts)")
    if capacity is None:
        return
    why = refusal(plan, capacity)
    if why:
        run.refuse(f"the trainer does not fit its {where}: {why}")
