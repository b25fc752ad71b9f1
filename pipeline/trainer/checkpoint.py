"""Per-rank trainer checkpoints: safetensors for tensors, JSON for scalars, no pickle.

Layout of a checkpoint directory (one set of files per world rank r)::

    rank00000.model.safetensors   this rank's megatron parameter shards (names as in the model)
    rank00000.optim.safetensors   AdamW moments "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.step"
    rank00000.rng.safetensors     "cpu" (torch CPU RNG), "cuda" (on GPU), "tracker.<name>" (megatron)
    rank00000.json                scalars: trainer steps, optimizer hyper-parameters, layout

Invariants: ``load`` after ``save`` restores parameters, optimizer state and RNG states bit for bit;
``load`` refuses a checkpoint written with another world size or TP/EP/ETP layout, naming both.
Only the torch optimizer (CPU path) is supported; the megatron distributed optimizer is refused.
"""
from __future__ import annotations

import json
from pathlib import Path


def _rank_prefix(directory: Path) -> Path:
    import torch

    return directory / f"rank{torch.distributed.get_rank():05d}"


def _layout(trainer) -> dict:
    import torch

    p = trainer.cfg.parallel
    return {"world_size": torch.distributed.get_world_size(), "tp": p.tp, "ep": p.ep, "etp": p.expert_tp}


def _check_torch_optimizer(trainer) -> None:
    if trainer.optimizer_kind != "torch":
        raise NotImplementedError("checkpointing the megatron distributed optimizer is not "
                                  "implemented; use optimizer='torch'")


def save_rank_state(trainer, directory: Path) -> None:
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from safetensors.torch import save_file

    _check_torch_optimizer(trainer)
    directory.mkdir(parents=True, exist_ok=True)
    prefix = _rank_prefix(directory)
    named = list(trainer.model.named_parameters())
    save_file({n: p.detach().cpu().contiguous() for n, p in named},
              str(prefix) + ".model.safetensors")
    state = trainer.optimizer.state_dict()
    moments = {}
    for idx, (name, _) in enumerate(named):
        for key, value in state["state"].get(idx, {}).items():
            moments[f"{name}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    save_file(moments, str(prefix) + ".optim.safetensors")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state().cpu()
    for name, value in get_cuda_rng_tracker().get_states().items():
        rng[f"tracker.{name}"] = value.cpu().contiguous()
    save_file(rng, str(prefix) + ".rng.safetensors")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    scalars = {"steps": trainer.steps, "param_groups": groups, "layout": _layout(trainer)}
    Path(str(prefix) + ".json").write_text(json.dumps(scalars, indent=1, default=list))
    torch.distributed.barrier()


def load_rank_state(trainer, directory: Path) -> None:
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from safetensors.torch import load_file

    _check_torch_optimizer(trainer)
    prefix = _rank_prefix(directory)
    meta_path = Path(str(prefix) + ".json")
    if not meta_path.exists():
        raise FileNotFoundError(f"no trainer checkpoint for this rank at {meta_path}")
    scalars = json.loads(meta_path.read_text())
    if scalars["layout"] != _layout(trainer):
        raise ValueError(f"checkpoint layout {scalars['layout']} differs from this trainer's "
                         f"{_layout(trainer)}")
    named = list(trainer.model.named_parameters())
    weights = load_file(str(prefix) + ".model.safetensors")
    with torch.no_grad():
        for name, p in named:
            p.copy_(weights[name])
    moments = load_file(str(prefix) + ".optim.safetensors")
    state = {}
    for idx, (name, p) in enumerate(named):
        entry = {key: moments[f"{name}.{key}"] for key in ("step", "exp_avg", "exp_avg_sq")
                 if f"{name}.{key}" in moments}
        if entry:
            state[idx] = {k: (v if k == "step" else v.to(p.device)) for k, v in entry.items()}
    groups = []
    for group in scalars["param_groups"]:
        group = dict(group)
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        groups.append(group)
    groups[0]["params"] = list(range(len(named)))
    trainer.optimizer.load_state_dict({"state": state, "param_groups": groups})
    rng = load_file(str(prefix) + ".rng.safetensors")
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(
        {k[len("tracker."):]: v for k, v in rng.items() if k.startswith("tracker.")})
    trainer.steps = scalars["steps"]
    torch.distributed.barrier()
