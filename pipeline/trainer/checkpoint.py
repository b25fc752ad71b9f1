"""Trainer checkpoints that any parallel layout can resume: tensors in Hugging Face names and shapes.

Layout of a checkpoint directory (tensor sets as in ``hf_shards``: files per writing rank plus an
index)::

    model-r*.safetensors     + model.safetensors.index.json       float32 weights (a bf16 model's fp32
                                                                  master weights), HF names
    exp_avg-r*.safetensors   + exp_avg.safetensors.index.json     Adam first moments, HF names
    exp_avg_sq-r*.safetensors + exp_avg_sq.safetensors.index.json Adam second moments
    rng-r00000.safetensors   one per world rank: "cpu", "cuda" (on GPU), "tracker.<name>"
    trainer.json             {"format": 2, "steps", "adam_step", "param_groups", "layout", "lora"}

A LoRA trainer (``pipeline.trainer.lora``) stores only its adapters and their Adam moments, under
their HF adapter names (``...q_proj.lora_A.weight``), and in ``trainer.json`` ``"lora"``: rank,
alpha, target patterns and ``base``, the resolved base checkpoint directory they adapt; a
checkpoint loads only into a trainer with the same LoRA setting (None for full-weight ones).

Resharding (own, not megatron's dist-checkpointing, which on megatron-core 0.16.1 needs CUDA for
the distributed optimizer and stores pickled common state): an Adam moment has exactly its
parameter's shape and is element-wise, so it is converted to and from Hugging Face layout by the
SAME rules as the weight it belongs to (QKV regrouping, gate/up halves, TP splits, expert ids per
EP rank) and cut for the loading rank like the weight. Adam's step count is one scalar for all
parameters (every parameter is updated every step) and is stored once.

- torch AdamW (CPU): moments are ``optimizer.state[param]``, already parameter-shaped per rank.
- megatron's distributed optimizer (CUDA): each data-parallel rank owns a contiguous range of
  each parameter's flattened moments; the full parameter-shaped moment is the sum over the DP group
  of zero tensors holding each rank's range (disjoint ranges, so the sum is exact). On load each
  rank copies its range back, then refreshes its main parameters from the model's.

A bf16 model keeps fp32 master weights (megatron's distributed optimizer: its main parameters,
each DP rank a range, gathered like the moments; the torch path: `pipeline.trainer.masters`): the
checkpoint stores the masters, and a load sets the bf16 weights to them rounded and the masters to
them exactly (reloading masters from the bf16 weights would truncate them).

Saving is three parts (`save_checkpoint` does all three at once): `snapshot_checkpoint` copies
every rank's share to host memory between two steps (the collective part), `write_snapshot` writes
one rank's files (no collective: `pipeline.trainer.checkpoint_writer` runs it in a background thread
while training goes on), `seal_checkpoint` indexes the sets and writes ``trainer.json`` on rank 0
once every rank's files are written.

Invariants: ``load`` after ``save`` restores weights (masters included) and optimizer state bit for bit on ANY
TP/EP/DP/PP layout of the same model (and the RNG states when the layout and world size are the
ones that saved); ``trainer.json`` is written last, after every rank's files, so a directory
without it is an incomplete checkpoint and ``load`` refuses it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FORMAT = 2
MOMENTS = ("exp_avg", "exp_avg_sq")


def _layout(trainer) -> dict:
    import torch

    p = trainer.cfg.parallel
    return {"world_size": torch.distributed.get_world_size(), "tp": p.tp, "ep": p.ep, "etp": p.expert_tp,
            **({"pp": p.pp} if p.pp > 1 else {})}


def _distributed_optimizers(trainer):
    return list(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]))


def _owning_distopt(trainer, param):
    for opt in _distributed_optimizers(trainer):
        if param in opt.model_param_gbuf_map:
            return opt
    raise KeyError("parameter not handled by any distributed optimizer")


def _adam_param(trainer, param):
    """The tensor the torch optimizer updates for model parameter ``param`` (its fp32 master, if any)."""
    return trainer.masters.of(param) if trainer.masters is not None else param


def _has_masters(trainer) -> bool:
    """Whether the optimizer keeps fp32 master weights distinct from the model's parameters."""
    if trainer.optimizer_kind == "torch":
        return trainer.masters is not None
    return trainer.cfg.parallel.params_dtype != "float32"


def _weights(trainer):
    """``value_of(name, param)`` giving the weight a checkpoint stores: the fp32 master if any."""
    if not _has_masters(trainer):
        return lambda name, param: param
    if trainer.optimizer_kind == "torch":
        return lambda name, param: trainer.masters.of(param)
    return _moment(trainer, "param")  # the distributed optimizer's main parameter ranges


def _moment(trainer, key: str):
    """``value_of(name, param)`` giving this rank's parameter-shaped moment ``key`` (distributed
    optimizer: also ``"param"``, its fp32 main parameter)."""
    import torch

    if trainer.optimizer_kind == "torch":
        def torch_moment(name, param):
            state = trainer.optimizer.state.get(_adam_param(trainer, param), {})
            return state[key] if key in state else torch.zeros_like(param)
        return torch_moment

    def distopt_moment(name, param):  # a collective over the optimizer's DP group
        opt = _owning_distopt(trainer, param)
        full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        if param in opt.model_param_group_index_map:
            span = opt._get_model_param_range_map(param)["param"]
            state = opt._get_main_param_and_optimizer_states(param)
            if key in state:
                full[span.start:span.end] = state[key].view(-1).float()
        torch.distributed.all_reduce(full, group=opt.data_parallel_group)
        return full.view(param.shape)
    return distopt_moment


def _lora_meta(trainer) -> dict | None:
    """The adapters' settings and the base they adapt (None: a full-weight checkpoint)."""
    if trainer.lora is None:
        return None
    c = trainer.lora.cfg
    return {"rank": c.rank, "alpha": c.alpha, "targets": list(c.targets),
            "base": str(Path(trainer.cfg.model_dir).resolve())}


def _adam_step(trainer) -> int:
    """Adam's step count, checked to be the same for every parameter of this rank: read where the
    optimizer keeps it, per parameter (torch's Adam: ``state[p]["step"]``) or per parameter group
    (fused Adams, TE's and Apex's: ``param_groups[i]["step"]``)."""
    if trainer.optimizer_kind == "torch":
        adams = [trainer.optimizer]
    else:
        adams = [opt.optimizer for opt in _distributed_optimizers(trainer)]
    states = [adam.state[p] for adam in adams for g in adam.param_groups for p in g["params"]
              if p in adam.state]
    states += [g for adam in adams for g in adam.param_groups]
    steps = {int(s["step"]) for s in states if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"parameters have different Adam step counts {sorted(steps)}; "
                         "a checkpoint stores one")
    return steps.pop() if steps else 0


def _param_groups(trainer) -> list[dict]:
    opt = trainer.optimizer if trainer.optimizer_kind == "torch" else _distributed_optimizers(trainer)[0].optimizer
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]


@dataclass
class CheckpointSnapshot:
    """One rank's part of a checkpoint, copied to host memory between two steps (training may go on
    while `write_snapshot` writes it)."""

    rank: int  # world rank that took it
    sets: dict  # tensor set prefix ("model", "exp_avg", "exp_avg_sq") -> {hf name: host tensor}
    rng: dict  # RNG states of this rank ("cpu", "cuda", "tracker.<name>")
    meta: dict  # trainer.json's content (written by rank 0 only, last)


def snapshot_checkpoint(trainer) -> CheckpointSnapshot:
    """This rank's checkpoint state as host copies (collective: every rank calls it)."""
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from .hf_shards import snapshot_tensor_set

    sets = {"model": snapshot_tensor_set(trainer.model, trainer.hf_config, _weights(trainer))}
    for key in MOMENTS:
        sets[key] = snapshot_tensor_set(trainer.model, trainer.hf_config, _moment(trainer, key))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state().cpu()
    for name, value in get_cuda_rng_tracker().get_states().items():
        rng[f"tracker.{name}"] = value.to("cpu", copy=True).contiguous()
    step = _adam_step(trainer)
    steps = trainer._all_reduce([step, -step], None, torch.distributed.ReduceOp.MAX).tolist()
    if steps[0] != -steps[1]:
        raise ValueError(f"ranks disagree on Adam's step count ({-steps[1]}..{steps[0]})")
    meta = {"format": FORMAT, "steps": trainer.steps, "adam_step": step,
            "param_groups": _param_groups(trainer), "layout": _layout(trainer),
            "lora": _lora_meta(trainer)}
    return CheckpointSnapshot(torch.distributed.get_rank(), sets, rng, meta)


def write_snapshot(snapshot: CheckpointSnapshot, directory: Path) -> None:
    """Write this rank's files of ``snapshot`` into ``directory`` (no collective: may run in a
    background thread)."""
    from safetensors.torch import save_file

    from .hf_shards import write_rank_files

    directory.mkdir(parents=True, exist_ok=True)
    for prefix, tensors in snapshot.sets.items():
        write_rank_files(tensors.items(), directory, prefix, snapshot.rank)
    save_file(snapshot.rng, str(directory / f"rng-r{snapshot.rank:05d}.safetensors"))


def seal_checkpoint(snapshot: CheckpointSnapshot, directory: Path) -> None:
    """On world rank 0, once every rank's files are written: the sets' indexes, then
    ``trainer.json`` (last: it makes the directory a complete checkpoint)."""
    from .hf_shards import write_index

    for prefix in snapshot.sets:
        write_index(directory, prefix)
    tmp = directory / "trainer.json.tmp"
    tmp.write_text(json.dumps(snapshot.meta, indent=1, default=list))
    tmp.replace(directory / "trainer.json")


def save_checkpoint(trainer, directory: Path) -> None:
    """Write the checkpoint now (collective: every rank calls it)."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    rank = torch.distributed.get_rank()
    if rank == 0 and (directory / "trainer.json").exists():
        (directory / "trainer.json").unlink()  # incomplete until rewritten below
    snapshot = snapshot_checkpoint(trainer)
    write_snapshot(snapshot, directory)
    torch.distributed.barrier()
    if rank == 0:
        seal_checkpoint(snapshot, directory)
    torch.distributed.barrier()


def load_checkpoint(trainer, directory: Path) -> None:
    """Restore weights, Adam state and (same layout only) RNG states from ``directory``."""
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from safetensors.torch import load_file

    from .hf_shards import set_reader
    from .conversion import unwrap
    from .model import iter_megatron_shards

    meta_path = directory / "trainer.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{directory} is not a complete trainer checkpoint (no trainer.json)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: checkpoint format {meta.get('format')!r}, this trainer "
                         f"reads format {FORMAT}")
    if meta.get("lora") != _lora_meta(trainer):
        raise ValueError(f"{meta_path}: checkpoint LoRA setting {meta.get('lora')} differs from this "
                         f"trainer's {_lora_meta(trainer)} (trainer.lora.* must match the run that saved it)")
    params = dict(unwrap(trainer.model).named_parameters())
    masters = {}  # name -> the fp32 weight as stored (a bf16 model's master)
    with torch.no_grad():
        for name, shard in iter_megatron_shards(trainer.model, trainer.hf_config,
                                                set_reader(directory, "model")):
            params[name].copy_(shard.to(params[name].dtype))
            if _has_masters(trainer):
                masters[name] = shard
        moments = {key: dict(iter_megatron_shards(trainer.model, trainer.hf_config,
                                                  set_reader(directory, key))) for key in MOMENTS}
    if trainer.optimizer_kind == "torch":
        if trainer.masters is not None:
            with torch.no_grad():
                for name, shard in masters.items():
                    trainer.masters.of(params[name]).copy_(shard)
        _load_torch_adam(trainer, params, moments, meta)
    else:
        _load_distopt(trainer, params, moments, meta, masters)
    if meta["layout"] == _layout(trainer):
        rng = load_file(str(directory / f"rng-r{torch.distributed.get_rank():05d}.safetensors"))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        get_cuda_rng_tracker().set_states(
            {k[len("tracker."):]: v for k, v in rng.items() if k.startswith("tracker.")})
    trainer.steps = meta["steps"]
    torch.distributed.barrier()


def _load_torch_adam(trainer, params, moments, meta) -> None:
    import torch

    order = {id(p): i for i, p in enumerate(trainer.trainable())}
    state = {}
    if meta["adam_step"]:
        for name in moments[MOMENTS[0]]:
            p = params[name]
            q = _adam_param(trainer, p)
            state[order[id(p)]] = {"step": torch.tensor(float(meta["adam_step"])),
                                   **{k: moments[k][name].to(q.device, q.dtype) for k in MOMENTS}}
    groups = []
    for group in meta["param_groups"]:
        group = dict(group)
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        groups.append(group)
    groups[0]["params"] = list(range(len(order)))
    trainer.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _load_distopt(trainer, params, moments, meta, masters) -> None:
    import torch

    for opt in _distributed_optimizers(trainer):
        opt.reload_model_params()
        if meta["adam_step"] and opt.init_state_fn is not None:
            opt.init_state_fn(opt.optimizer, opt.config)
    with torch.no_grad():  # the masters as saved, not as reloaded from the bf16 weights
        for name, shard in masters.items():
            p = params[name]
            opt = _owning_distopt(trainer, p)
            if p in opt.model_param_group_index_map:
                span = opt._get_model_param_range_map(p)["param"]
                main = opt._get_main_param_and_optimizer_states(p)["param"]
                main.view(-1).copy_(shard.reshape(-1)[span.start:span.end].to(main.device, main.dtype))
    if not meta["adam_step"]:
        return
    for opt in _distributed_optimizers(trainer):  # a fused Adam counts its steps per group
        for group in opt.optimizer.param_groups:
            if "step" in group:
                group["step"] = meta["adam_step"]
    with torch.no_grad():
        for name in moments[MOMENTS[0]]:
            p = params[name]
            opt = _owning_distopt(trainer, p)
            if p not in opt.model_param_group_index_map:
                continue
            span = opt._get_model_param_range_map(p)["param"]
            group_index, order = opt.model_param_group_index_map[p]
            main = opt.optimizer.param_groups[group_index]["params"][order]
            state = opt.optimizer.state[main]
            for key in MOMENTS:
                state[key].copy_(moments[key][name].reshape(-1)[span.start:span.end].to(state[key].device))
            step = torch.tensor(float(meta["adam_step"]))
            if "step" in state:
                state["step"].copy_(step)
            else:
                state["step"] = step.to(state["exp_avg"].device) if opt.optimizer.defaults.get(
                    "capturable") or opt.optimizer.defaults.get("fused") else step
