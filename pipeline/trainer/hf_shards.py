"""Hugging Face-format tensor sets that every rank writes and reads for its own part: the trainer's
layout-independent checkpoints (weights and Adam moments) and the streamed Hugging Face export.

A tensor set is a directory holding ``{prefix}-r{rank:05d}-{k:05d}.safetensors`` files and
``{prefix}.safetensors.index.json`` (Hugging Face's sharded format: ``{"metadata": {"total_size"},
"weight_map": {name: file}}``), so a set with prefix ``model`` plus ``config.json`` is a checkpoint
transformers and vLLM load.

Invariants:
- Names and shapes are the Hugging Face checkpoint's (per-expert names, ``[out, in]`` matrices),
  whatever TP/EP/DP layout wrote the set; HF -> megatron -> HF is the identity bit for bit, so a
  set written by one layout loads into any other exactly. Adam moments have their parameter's
  shape and are converted by the same rules.
- Writing is a collective (every rank calls ``write_tensor_set`` with the same arguments). Each
  full tensor is assembled by an all-gather inside the tensor-parallel group (expert-TP group for
  experts) of ONE owner and written by that owner's first rank: dense tensors by data-parallel
  rank 0's TP rank 0, an expert by expert-TP rank 0 of expert-data-parallel rank 0 of the EP rank
  that holds it. There is no gather over EP or DP: no rank holds more than one full tensor plus
  ``shard_bytes`` of pending output, and each writer writes only its own files.
- Reading is local: each rank reads only the tensors its shards need (``iter_megatron_shards``).

Worked example: TP2 x EP2 on 4 ranks, 8 experts (megatron puts ranks {0,1} in a TP group and
{0,2} in an EP group): rank 0 writes the dense tensors and experts 0-3, rank 2 writes experts
4-7, ranks 1 and 3 only take part in the gathers. A DP2 x EP2 trainer (tp 1) then cuts experts
4-7 for its EP rank 1 from rank 2's files, and a one-rank trainer reads everything.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

INDEX_SUFFIX = ".safetensors.index.json"
SHARD_BYTES = 256 * 2**20
"""Largest file a rank writes of a tensor set (and the output it holds pending while streaming)."""


def _writes(rule) -> tuple[bool, bool]:
    """(this rank's group assembles the tensor, this rank writes it)."""
    from megatron.core import parallel_state as ps

    if rule.expert is not None:
        group_writes = ps.get_expert_data_parallel_rank() == 0
        return group_writes, group_writes and ps.get_expert_tensor_parallel_rank() == 0
    group_writes = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    return group_writes, group_writes and ps.get_tensor_model_parallel_rank() == 0


def owned_hf_tensors(model, hf_config, value_of: Callable) -> Iterator[tuple[str, "torch.Tensor"]]:
    """``(hf_name, full float32 tensor)`` for the tensors this rank writes; a collective every rank
    must exhaust. ``value_of(megatron_name, param)`` gives the per-rank value to convert (the
    parameter, an optimizer moment); it is called on every rank for every parameter in the same
    order, so it may itself be a collective (the distributed optimizer's moments are)."""
    import torch

    from .conversion import conversion_rules, gather_full, unwrap

    params = dict(unwrap(model).named_parameters())
    for rule in conversion_rules(hf_config, model):
        value = value_of(rule.megatron, params[rule.megatron]).detach().to(torch.float32)
        group_writes, writes = _writes(rule)
        if not group_writes:
            continue
        full = gather_full(rule, value, hf_config)
        if writes:
            yield from zip(rule.hf, full)


def write_tensor_set(model, hf_config, directory: Path, prefix: str, value_of: Callable,
                     dtype=None, shard_bytes: int = SHARD_BYTES) -> None:
    """Write this rank's tensors of the set ``prefix`` into ``directory`` (collective), then, on
    world rank 0 after a barrier, the index over every rank's files."""
    import torch

    rank = torch.distributed.get_rank()
    tensors = ((name, tensor if dtype is None else tensor.to(dtype))
               for name, tensor in owned_hf_tensors(model, hf_config, value_of))
    write_rank_files(tensors, directory, prefix, rank, shard_bytes)  # streamed: shard_bytes held at most
    torch.distributed.barrier()
    if rank == 0:
        write_index(directory, prefix)
    torch.distributed.barrier()


def snapshot_tensor_set(model, hf_config, value_of: Callable) -> dict[str, "torch.Tensor"]:
    """This rank's tensors of a set as host-memory copies that later training steps cannot change
    (collective, like ``write_tensor_set``); ``write_rank_files`` writes them, ``write_index`` indexes
    the set once every rank's files are there (an asynchronous checkpoint, `pipeline.trainer.checkpoint`)."""
    return {name: tensor.to("cpu", copy=True).contiguous()
            for name, tensor in owned_hf_tensors(model, hf_config, value_of)}


def write_rank_files(tensors, directory: Path, prefix: str, rank: int, shard_bytes: int = SHARD_BYTES) -> None:
    """Write ``(hf_name, tensor)`` pairs as this rank's files of the set ``prefix`` (no collective),
    replacing an earlier attempt's files of this rank."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob(f"{prefix}-r{rank:05d}-*.safetensors"):  # an earlier attempt's
        old.unlink()
    pending, size, k = {}, 0, 0

    def flush():
        nonlocal pending, size, k
        if pending:
            save_file(pending, str(directory / f"{prefix}-r{rank:05d}-{k:05d}.safetensors"),
                      metadata={"format": "pt"})
            pending, size, k = {}, 0, k + 1

    for name, tensor in tensors:
        pending[name] = tensor.cpu().contiguous()
        size += pending[name].numel() * pending[name].element_size()
        if size >= shard_bytes:
            flush()
    flush()


def write_index(directory: Path, prefix: str) -> Path:
    """``{prefix}.safetensors.index.json`` over the set's files (read from their headers)."""
    from safetensors import safe_open

    weight_map, total = {}, 0
    for f in sorted(directory.glob(f"{prefix}-r*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                if name in weight_map:
                    raise ValueError(f"{name} is written twice ({weight_map[name]}, {f.name})")
                weight_map[name] = f.name
                sl = h.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}.get(sl.get_dtype(), 4)
    path = directory / f"{prefix}{INDEX_SUFFIX}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    tmp.replace(path)
    return path


def set_reader(directory: Path, prefix: str):
    """``read(hf_name)`` over the set ``prefix`` in ``directory`` (its index lists the files)."""
    from .model import hf_tensor_reader

    index = Path(directory) / f"{prefix}{INDEX_SUFFIX}"
    if not index.exists():
        raise FileNotFoundError(f"no tensor set {prefix!r} in {directory} (missing {index.name})")
    files = sorted({Path(directory) / f for f in json.loads(index.read_text())["weight_map"].values()})
    return hf_tensor_reader(files, f"{directory}/{prefix}")
