"""Copying the received tensors vLLM's layerwise reload still holds out of a buffer about to be reused.

A streamed receive (`pipeline.weights.group`) hands out views of two bucket buffers and reuses
the buffer of bucket k-1 for bucket k+1 as soon as bucket k is asked for. vLLM's layerwise reload
(``reload_weights``, ``vllm/model_executor/model_loader/reload/layerwise.py``) does not load a
tensor when it gets it: it records the weight loader's arguments (the tensor among them) in the
module's ``LayerReloadingInfo.loaded_weights`` and loads them all once the module has received
every element. A module whose tensors straddle a bucket boundary (q in bucket k-1, k and v in
bucket k), a module vLLM loads only at the end (one whose parameter is padded beyond the
checkpoint's shape, e.g. a vocabulary padded to a multiple of 64) and, on GPU, a fused MoE layer
whose experts span many buckets thus hold views of a buffer after it has been handed on.

Invariants (imports neither vLLM nor torch at module level):
- `copy_held_views` replaces every tensor argument recorded by a module still loading that lies in
  the given buffer by a copy, and returns the bytes copied; afterwards nothing the reload holds
  points into the buffer, so receiving the next bucket there cannot change a pending load.
- Nothing else of the reload's state changes: the counts of loaded elements, the order of the
  recorded calls and every argument outside the buffer stay as they were.

Example: a plan of 64 MiB buckets whose bucket 7 ends with layer 3's q_proj (8 MiB) and whose
bucket 8 starts with its k_proj and v_proj: when bucket 8 is asked for, layer 3's ``qkv_proj``
holds the q view in buffer 1; asking for bucket 9 (into buffer 1) copies those 8 MiB first. Plans
keep a fused module in one bucket where it fits (`pipeline.weights.bucket_plan.BucketPlan.from_specs`),
so on a dense model the only copies are of modules loaded at the end.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def copy_held_views(buffer: "torch.Tensor") -> int:
    """Copy each tensor a loading module recorded that lies in ``buffer``; returns the bytes copied."""
    import torch
    from vllm.model_executor.model_loader.reload import layerwise

    start = buffer.untyped_storage().data_ptr()
    end = start + buffer.untyped_storage().nbytes()
    copied = 0
    for info in list(layerwise.LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in list(bound.arguments.items()):
                if isinstance(value, torch.Tensor) and not value.is_meta and start <= value.data_ptr() < end:
                    bound.arguments[key] = value.clone()
                    copied += value.numel() * value.element_size()
    return copied
