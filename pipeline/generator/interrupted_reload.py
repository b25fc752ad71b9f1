"""What an interrupted in-place weight load leaves inside an engine worker, and putting it right.

vLLM's layerwise reload (``reload_weights``, ``vllm/model_executor/model_loader/reload/layerwise.py``)
first moves every module's parameters and buffers to the meta device, keeping the live tensors
aside (``kernel_tensors``); a module gets them back, filled with the new weights, once all of its
weights have arrived, and a module that receives none (the rotary embedding with its
``cos_sin_cache`` buffer, the attention layers) only in the reload's final pass. When the weights
iterator raises (a sender died mid-broadcast, a timeout), that final pass never runs: the
unfinished modules stay on meta, and their half-collected loads stay recorded in vLLM's per-module
reload state, which the next reload would count, finishing those modules before all their new
weights are in. An engine step on such a model fails ("Cannot copy out of meta tensor") and kills
the engine; a staged update swapped in by reference (`pipeline.generator.kernel_swap`) replaces
parameters only, so it would leave the meta buffers behind too.

Invariants (imports neither vLLM nor torch at module level):
- `put_back_unfinished_modules` gives each module the reload left unfinished the tensors it had
  before the reload (their storage is untouched: vLLM writes a module's tensors only when the
  module completes) and resets the reload state of every module. Afterwards no tensor is on meta,
  the modules that completed hold the new weights, all others the old ones: a mix, which is why the
  driver keeps the engine paused until a complete version is loaded. Example, tiny dense model in
  256 KiB buckets, the sender dying at bucket 12 of 27: ``lm_head``, ``embed_tokens``, layer 0's
  input norm and down projection (and, when bucket 11 arrived, more of layer 0) complete (new
  version); layer 0's q/k/v and output projections and rotary embedding, all of layer 1 and the
  final norm are put back (old version), 15-17 modules in all.
- `tensors_without_data` lists the parameters and buffers on meta: empty after every complete load.
"""
from __future__ import annotations

import itertools
from typing import Any


def put_back_unfinished_modules(model: Any) -> list[str]:
    """After a reload whose weights iterator raised: each module the reload left unfinished gets
    its tensors from before the reload back, every module's reload state is reset (module
    docstring); returns the names of the modules with tensors of their own put back."""
    from vllm.model_executor.model_loader.reload import layerwise

    put_back = []
    for name, module in model.named_modules():
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is None or not info.can_load():  # not in a reload, or finished
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(module, info)
            if any(info.kernel_tensors):  # a module with tensors of its own
                put_back.append(name)
        info.reset()
    layerwise.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    return put_back


def tensors_without_data(model: Any) -> list[str]:
    """Names of the model's parameters and buffers on the meta device (no storage: a step would fail)."""
    return [name for name, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
