"""Small, documented patches that let megatron-core run on CPU over gloo.

Invariants this package keeps:
- ``apply_cpu_patches()`` is idempotent: the second call does nothing and returns the same list.
- On a machine where CUDA is available no CPU patch is applied (megatron-core runs as shipped);
  only version-independent feature fixes (``moe_te_general_gemm``) are applied there.
- Every CPU patch names the megatron-core version it was written against (``TARGET_VERSION``);
  on CPU, applying them to any other version raises ``RuntimeError`` naming both versions, because
  the patched internals are private and may have moved.
- Patches replace attributes only (functions on ``torch.cuda`` and megatron modules, or
  ``WrappedTorchNorm.__new__``); they never edit files on disk.

On CPU, "the CUDA RNG" that megatron's RNG tracker forks is mapped onto torch's CPU default
generator: ``tracker.add(name, seed)`` stores a CPU generator state, and ``tracker.fork(name)``
swaps the CPU generator to it and back, which is what dropout inside tensor-parallel regions needs.

Patches (each function's docstring says what, why and the version):
  always: moe_te_general_gemm
  cpu:    cuda_current_device, cuda_streams, cuda_rng, default_causal_mask, moe_split_sizes,
          torch_norm_sequence_parallel

Example::

    from megatron_patches import apply_cpu_patches
    applied = apply_cpu_patches()   # on CPU: all seven names above, in that order
    # now build megatron-core models with use_cpu_initialization=True and a gloo process group

A later routing-replay patch (Keep Routing) registers itself in ``_PATCHES`` the same
way; it is not CPU-specific and would go into the ``always`` group (feature-detected, so it can
serve the GPU path's newer megatron-core too). ``torch_norm_sequence_parallel`` would also be
needed on a GPU without TransformerEngine for TP > 1 MoE; it stays CPU-only until checked there.
"""
from __future__ import annotations

import contextlib
from typing import Callable

TARGET_VERSION = "0.16.1"

_applied: list[str] | None = None


def _megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


# --------------------------------------------------------------------------------------------
# Patches applied everywhere (feature detection, safe on any version)
# --------------------------------------------------------------------------------------------


def _patch_moe_te_general_gemm() -> None:
    """What: define ``moe_utils.te_general_gemm = None`` when TransformerEngine is absent.

    Why: megatron-core 0.16.1 imports ``te_general_gemm`` inside a try block and, without
    TransformerEngine, never defines the name; ``RouterGatingLinearFunction.forward`` then raises
    NameError on every MoE router call. ``None`` selects its plain ``torch.mm`` branch.
    Version: found in 0.16.1; applied only when the name is missing, so harmless elsewhere.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# --------------------------------------------------------------------------------------------
# CPU-only patches (megatron-core 0.16.1)
# --------------------------------------------------------------------------------------------


def _patch_cuda_current_device() -> None:
    """What: ``torch.cuda.current_device()`` returns ``torch.device('cpu')``.

    Why: megatron-core 0.16.1 allocates buffers with ``device=torch.cuda.current_device()`` in
    about 60 places (DDP grad buffers, all-to-all outputs, router weights); on CPU that raises.
    """
    import torch

    torch.cuda.current_device = lambda: torch.device("cpu")


class _NoStream:
    """A stand-in for ``torch.cuda.Stream``/``Event``: CPU work is already ordered, so every
    synchronisation method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return _NoStream()

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


def _patch_cuda_streams() -> None:
    """What: ``torch.cuda.Stream/Event/current_stream/default_stream/stream/synchronize`` become
    no-op stand-ins.

    Why: megatron-core 0.16.1 DDP (overlapped grad reduction), the MoE all-to-all dispatcher (its
    device-to-host side stream) and ``tensor.record_stream`` call these unconditionally.
    """
    import torch

    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.default_stream = lambda device=None: _NoStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    original_record_stream = torch.Tensor.record_stream

    def record_stream(tensor, stream):
        if isinstance(stream, _NoStream):
            return None
        return original_record_stream(tensor, stream)

    torch.Tensor.record_stream = record_stream


def _patch_cuda_rng() -> None:
    """What: torch's CUDA RNG functions and ``megatron.core.tensor_parallel.random``'s private
    ``_get_cuda_rng_state``/``_set_cuda_rng_state`` operate on torch's CPU default generator.

    Why: ``model_parallel_cuda_manual_seed`` and the ``CudaRNGStatesTracker`` (add/fork) call them
    during model construction and in every forward pass with dropout or TP-local initialisation.
    """
    import torch
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(device=None, clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all (a lazy no-op without CUDA),
    # so only the single-device seed is redirected, and to the generator, not torch.manual_seed.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state


def _patch_default_causal_mask() -> None:
    """What: ``get_default_causal_mask`` builds its mask on CPU (in ``transformer.utils`` and in
    ``fusions.fused_softmax``, which imported it by name).

    Why: megatron-core 0.16.1 hard-codes ``device="cuda"`` there; the local (non-TE) attention
    calls it whenever no explicit attention mask is given (causal self-attention).
    """
    import functools

    import torch
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    @functools.lru_cache(maxsize=8)
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    utils.get_default_causal_mask = causal_mask
    fused_softmax.get_default_causal_mask = causal_mask


def _patch_moe_split_sizes() -> None:
    """What: ``tensor_parallel.mappings._AllToAll`` receives split sizes as ``list[int]``.

    Why: the MoE all-to-all dispatcher passes split sizes as numpy arrays or tensors; NCCL accepts
    them, gloo's ``all_to_all_single`` wants an int sequence and raises otherwise.
    """
    from megatron.core.tensor_parallel import mappings

    forward = mappings._AllToAll.forward

    def as_ints(sizes):
        if sizes is None:
            return None
        if hasattr(sizes, "tolist"):
            sizes = sizes.tolist()
        return [int(s) for s in sizes]

    def forward_with_int_splits(ctx, group, input, output_split_sizes, input_split_sizes):
        return forward(ctx, group, input, as_ints(output_split_sizes), as_ints(input_split_sizes))

    mappings._AllToAll.forward = staticmethod(forward_with_int_splits)


def _patch_torch_norm_sequence_parallel() -> None:
    """What: megatron's ``WrappedTorchNorm`` accepts ``sequence_parallel=True`` and marks its
    parameters ``sequence_parallel`` (so ``finalize_model_grads`` all-reduces their gradients over
    the tensor-parallel group, as it does for TransformerEngine's norms).

    Why: megatron-core 0.16.1's torch norm asserts ``not config.sequence_parallel``, but TP>1 with
    MoE requires sequence parallelism, and on CPU there is no TransformerEngine/Apex norm.
    A norm is element-wise over the hidden dimension, so it is correct on sequence shards.
    """
    import copy

    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
            zero_centered_gamma=False, normalization="LayerNorm"):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = original_new(cls, config, hidden_size, eps, persist_layer_norm,
                            zero_centered_gamma, normalization)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", sequence_parallel)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


# name -> (patch, group); "always" patches are feature-detected fixes, "cpu" patches are version-pinned
_PATCHES: list[tuple[str, Callable[[], None], str]] = [
    ("moe_te_general_gemm", _patch_moe_te_general_gemm, "always"),
    ("cuda_current_device", _patch_cuda_current_device, "cpu"),
    ("cuda_streams", _patch_cuda_streams, "cpu"),
    ("cuda_rng", _patch_cuda_rng, "cpu"),
    ("default_causal_mask", _patch_default_causal_mask, "cpu"),
    ("moe_split_sizes", _patch_moe_split_sizes, "cpu"),
    ("torch_norm_sequence_parallel", _patch_torch_norm_sequence_parallel, "cpu"),
]


def apply_cpu_patches(force_cpu: bool = False) -> list[str]:
    """Apply the patches this machine needs; return their names. Idempotent.

    On a CUDA machine (unless ``force_cpu``) only the ``always`` patches are applied, so the GPU
    path tolerates any megatron-core version (e.g. 0.17+ on Python 3.12). On CPU the installed
    megatron-core must be ``TARGET_VERSION``; otherwise ``RuntimeError`` is raised before anything
    is changed.
    """
    global _applied
    if _applied is not None:
        return list(_applied)
    import torch

    on_cpu = force_cpu or not torch.cuda.is_available()
    if on_cpu:
        installed = _megatron_version()
        if installed != TARGET_VERSION:
            raise RuntimeError(
                f"megatron_patches targets megatron-core {TARGET_VERSION} for CPU, but "
                f"{installed} is installed; re-check each patch in megatron_patches/ against it")
    applied = []
    for name, patch, group in _PATCHES:
        if group == "always" or on_cpu:
            patch()
            applied.append(name)
    _applied = applied
    return list(applied)


def applied_patches() -> list[str]:
    """Names of the patches applied in this process (empty before ``apply_cpu_patches``)."""
    return list(_applied or [])
