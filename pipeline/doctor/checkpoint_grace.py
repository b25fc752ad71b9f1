"""The doctor's checkpoint-grace check: will a checkpoint fit in the time a stop signal leaves?

A stopped run (preemption, the time limit's checkpoint signal, ``tokenflow cancel``) saves at the
trainer's next step boundary and must finish before it is killed. This check estimates the save
and refuses a configuration whose grace cannot cover it, naming the numbers.

- size (`checkpoint_size`): a checkpoint stores, in float32, the weights (a bf16 model's fp32
  masters), Adam's two moments (`pipeline.trainer.checkpoint`): 12 bytes per trained parameter
  (LoRA: its adapters only), plus the Hugging Face export with ``trainer.export=checkpoints``.
  Dense tensors are written by one rank (TP rank 0 of DP rank 0, after a gather), experts by one
  rank per EP rank: the largest rank's share is dense + experts / EP. Parameters are counted from
  the model's config (`parameter_count`; the supported families, `pipeline.trainer.families`);
- bandwidth (`write_bandwidth`): a short write probe in the run's checkpoint directory (its
  nearest existing ancestor before the first run): 1 MiB writes for at most ``PROBE_BYTES`` or
  ``PROBE_S`` seconds, then fsync, timed together, the file removed;
- save time = the checkpoint's bytes / that bandwidth (all ranks' writes share the filesystem:
  one client's probe, so a parallel filesystem's aggregate makes it an upper bound); needed =
  the save time, twice with ``run.async_checkpoints`` (a save in flight completes first);
- not counted, only reported: a weight broadcast in flight when the generators stop holds the
  trainer inside the collective until ``generator.weight_timeout_s`` before it reaches its step
  boundary (measured on the test cluster: with the default 120 s, no save at all in a 60 s grace);
- graces: locally `tokenflow cancel`'s (`pipeline.launch.local.CANCEL_GRACE_S`, also what SIGTERM to
  ``tokenflow train`` gives); on Slurm ``cluster.stop_grace_s`` (checkpoint signal to requeue)
  and the GraceTime of every preemptible partition the run uses (SIGTERM to SIGKILL).

Worked example: Qwen3-30B-A3B (30.5e9 parameters) -> 366 GB; at a probed 2 GB/s, 183 s a save,
366 s needed with async saves: refused against stop_grace_s 60 ("raise cluster.stop_grace_s to
at least 366 and cluster.signal_delay_s above it, ..."). The demo's tiny-moe (2.2 M parameters):
27 MB, well under a second.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.doctor.registry import Run, check

PROBE_BYTES = 32 * 2**20
"""At most this much is written by the bandwidth probe."""
PROBE_S = 2.0
"""The probe stops writing after this many seconds (a slow filesystem is measured on less)."""
STORED_BYTES_PER_PARAM = 12
"""float32 weight + two float32 Adam moments."""


@dataclass
class CheckpointSize:
    """What one checkpoint of the run writes."""

    params: int  # parameters trained (and stored)
    total_bytes: int  # every rank's files together (export included)
    largest_rank_bytes: int  # the rank that writes the most


def _moe_experts(hf) -> int:
    for name in ("num_experts", "num_local_experts"):
        if getattr(hf, name, None):
            return int(getattr(hf, name))
    return 0


def _linears(hf) -> list[tuple[str, int, int, int]]:
    """(megatron module name in layer 0, input size, output size, copies per layer) of the
    adaptable linear layers of one decoder layer."""
    from pipeline.trainer.families import head_dim

    h, d = hf.hidden_size, head_dim(hf)
    heads, kv = hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    out = [("decoder.layers.0.self_attention.linear_qkv", h, (heads + 2 * kv) * d, 1),
           ("decoder.layers.0.self_attention.linear_proj", heads * d, h, 1)]
    experts = _moe_experts(hf)
    if experts:
        i = hf.moe_intermediate_size
        out += [("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1", h, 2 * i, experts),
                ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2", i, h, experts)]
    else:
        i = hf.intermediate_size
        out += [("decoder.layers.0.mlp.linear_fc1", h, 2 * i, 1), ("decoder.layers.0.mlp.linear_fc2", i, h, 1)]
    return out


def parameter_count(hf) -> tuple[int, int]:
    """(dense, expert) parameters of a model of the supported families, from its config."""
    from pipeline.trainer.families import has_qk_norm, has_qkv_bias, head_dim

    h, d, layers = hf.hidden_size, head_dim(hf), hf.num_hidden_layers
    heads, kv = hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    embeddings = hf.vocab_size * h * (1 if getattr(hf, "tie_word_embeddings", False) else 2)
    per_layer = 2 * h  # input and post-attention RMSNorm
    per_layer += 2 * d if has_qk_norm(hf) else 0
    per_layer += (heads + 2 * kv) * d if has_qkv_bias(hf) else 0
    experts = _moe_experts(hf)
    per_layer += h * experts  # the router
    dense_linears = sum(i * o for name, i, o, n in _linears(hf) if ".experts." not in name)
    expert_linears = sum(i * o * n for name, i, o, n in _linears(hf) if ".experts." in name)
    return embeddings + h + layers * (per_layer + dense_linears), layers * expert_linears


def checkpoint_size(cfg, hf) -> CheckpointSize:
    """The bytes one checkpoint of this run writes (module docstring)."""
    p, lora = cfg.trainer.parallel, cfg.trainer.lora
    dense, expert = parameter_count(hf)
    ep = max(1, p.ep)
    if lora.rank > 0:  # the adapters alone: rank x (in + out) per targeted linear
        per = [(n, lora.rank * (i + o) * copies) for n, i, o, copies in _linears(hf)
               if any(re.search(t, n) for t in lora.targets)]
        dense = hf.num_hidden_layers * sum(x for n, x in per if ".experts." not in n)
        expert = hf.num_hidden_layers * sum(x for n, x in per if ".experts." in n)
    trained = dense + expert
    total = STORED_BYTES_PER_PARAM * trained
    largest = STORED_BYTES_PER_PARAM * (dense + expert // ep)
    if cfg.trainer.export == "checkpoints":
        sum_dense, sum_expert = parameter_count(hf)
        width = 4 if p.params_dtype == "float32" else 2
        total += width * (sum_dense + sum_expert)
        largest += width * (sum_dense + sum_expert // ep)
    return CheckpointSize(trained, total, largest)


def write_bandwidth(directory: Path) -> float:
    """Bytes per second a probe file in ``directory`` was written and fsynced at (module docstring)."""
    probe = directory / f".tokenflow-write-probe-{os.getpid()}"
    chunk = os.urandom(2**20)
    written = 0
    t0 = time.monotonic()
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while written < PROBE_BYTES and (written == 0 or time.monotonic() - t0 < PROBE_S):
                written += os.write(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        elapsed = time.monotonic() - t0
    finally:
        probe.unlink(missing_ok=True)
    return written / max(elapsed, 1e-6)


def checkpoint_place(cfg) -> Path:
    """The run's checkpoint directory, or its nearest existing ancestor before the first run."""
    from pipeline.run_files import CHECKPOINTS_DIR

    place = Path(cfg.run.dir).resolve() / CHECKPOINTS_DIR
    while not place.exists():
        place = place.parent
    return place


def graces(run: Run) -> dict[str, float]:
    """Seconds each way of stopping this run leaves a save, by what sets them."""
    cfg, plan = run.cfg, run.plan
    if cfg.cluster.launcher == "local":
        from pipeline.launch.local import CANCEL_GRACE_S
        return {"tokenflow cancel / a stop signal to tokenflow train (SIGKILL after)": CANCEL_GRACE_S}
    out = {"cluster.stop_grace_s (checkpoint signal to requeue)": float(plan.stop_grace_s)}
    if shutil.which("scontrol"):
        from pipeline.launch.slurm_checks import query_cluster
        partitions, _ = query_cluster()
        default = next((p.name for p in partitions.values() if p.default), None)
        for role, spec in plan.components.items():
            part = partitions.get(spec.partition or default)
            if part is not None and part.preempt_mode.upper() != "OFF":
                out[f"GraceTime of partition {part.name} (preemption, {role})"] = float(part.grace_s)
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


@check("checkpoint-grace")
def checkpoint_grace(run: Run) -> None:
    from pipeline.models.defaults import model_config

    assess_grace(run, model_config(run.cfg.model.name))


def assess_grace(run: Run, hf) -> None:
    """Report the save's size, bandwidth and time for a model of config ``hf``; refuse each grace
    shorter than the time needed at a stop."""
    cfg = run.cfg
    size = checkpoint_size(cfg, hf)
    place = checkpoint_place(cfg)
    bandwidth = write_bandwidth(place)
    save_s = size.total_bytes / bandwidth
    needed = save_s * (2 if cfg.run.async_checkpoints else 1)
    run.uses(f"a checkpoint: {size.params:,} parameters trained, {_gb(size.total_bytes)} (largest rank "
             f"{_gb(size.largest_rank_bytes)}); {place} took writes at {_gb(bandwidth)}/s: "
             f"{save_s:.1f} s a save, {needed:.1f} s needed at a stop"
             + (" (async: a save in flight completes first)" if cfg.run.async_checkpoints else ""))
    if cfg.run.async_checkpoints:
        run.uses(f"asynchronous saves hold {_gb(size.largest_rank_bytes)} of host memory on the largest rank while writing")
    late = cfg.generator.weight_timeout_s  # a broadcast in flight to stopping generators ends only then
    for what, grace in graces(run).items():
        if needed <= grace < needed + late and cfg.cluster.generators:
            run.uses(f"{what} ({grace:.0f} s) covers the save but not a weight broadcast in flight when the "
                     f"generators stop, which holds the trainer up to generator.weight_timeout_s={late:.0f} s")
        if grace < needed:
            run.refuse(f"a checkpoint needs {needed:.0f} s ({_gb(size.total_bytes)} at {_gb(bandwidth)}/s"
                       f"{', twice: one in flight, then the stop' if cfg.run.async_checkpoints else ''}) "
                       f"but {what} gives {grace:.0f} s: raise cluster.stop_grace_s (and cluster.signal_delay_s "
                       f"above it) or the partition's GraceTime, put {place} on a faster filesystem, "
                       f"or train fewer parameters (trainer.lora.rank)")
