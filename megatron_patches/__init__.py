"""Small, documented patches that let megatron-core run on CPU over gloo, and the few a GPU
trainer needs for some layouts; chosen by device AND layout (``select_patches``).

Invariants this package keeps:
- ``apply_patches()`` is idempotent: a patch is applied at most once per process; a later call
  for another configuration only adds the patches it needs.
- Which patches a configuration gets is a pure function (``select_patches(device,
  sequence_parallel, norm)``), testable on a CPU machine for a GPU layout.
- "cpu" patches name the megatron-core version they were written against (``TARGET_VERSION``);
  on CPU, applying them to any other version raises ``RuntimeError`` naming both versions,
  because the patched internals are private and may have moved.
- Patches replace attributes only (functions on ``torch.cuda`` and megatron modules, or
  ``WrappedTorchNorm.__new__``); they never edit files on disk.

On CPU, "the CUDA RNG" that megatron's RNG tracker forks is mapped onto torch's CPU default
generator: ``tracker.add(name, seed)`` stores a CPU generator state, and ``tracker.fork(name)``
swaps the CPU generator to it and back, which is what dropout inside tensor-parallel regions needs.

Patches (each function's docstring says what, why and the version; the cpu and gloo ones in
``megatron_patches.cpu``), by condition:
  always:        moe_te_general_gemm, varlen_attention - the local spec's core attention becomes
                 ``pipeline.trainer.attention``'s ``VarlenAttention`` (both batch layouts,
                 ``trainer.layout``), on CPU and on GPU alike
  cpu:           cuda_current_device, cuda_streams, cuda_rng, default_causal_mask,
                 schedule_token_count
  gloo (= cpu):  moe_split_sizes, gloo_uneven_gather_scatter
  torch_norm_sp: torch_norm_sequence_parallel - sequence parallelism (MoE with TP > 1) with a
                 layer spec whose norm is megatron's ``WrappedTorchNorm`` (the local spec with
                 RMSNorm always is, Apex or not), on CPU and on GPU alike

Example::

    from megatron_patches import apply_patches, select_patches
    select_patches("cuda", sequence_parallel=True)  # ['moe_te_general_gemm', 'varlen_attention', 'torch_norm_sequence_parallel']
    applied = apply_patches("cpu", sequence_parallel=True)   # on CPU: all ten
    # now build megatron-core models with use_cpu_initialization=True and a gloo process group

A later routing-replay patch (Keep Routing, see docs/architecture.md) registers itself in
``_PATCHES`` the same way under "always" (feature-detected, so it can serve the GPU path's newer
megatron-core too).
"""
from __future__ import annotations

from typing import Callable

from megatron_patches import cpu

TARGET_VERSION = "0.16.1"

_applied: list[str] = []


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


def _patch_varlen_attention() -> None:
    """What: ``LocalSpecProvider.core_attention`` (the core attention of megatron's local layer
    spec) returns ``pipeline.trainer.attention.VarlenAttention`` instead of ``DotProductAttention``.

    Why: megatron-core 0.16.1's ``DotProductAttention`` asserts ``packed_seq_params is None`` and
    materialises the S x S score matrix; packed sequences exist only through TransformerEngine,
    which is absent on CPU and on the GPU machine tested. Models built after this patch (the
    trainer builds after ``apply_patches``) attend per sequence in memory linear in length, packed
    and padded batches through the same code (so the two layouts agree to rounding).
    Version: found in 0.16.1; the provider method is public and replaced as a whole.
    """
    from megatron.core.models.backends import LocalSpecProvider

    from pipeline.trainer.attention import VarlenAttention

    LocalSpecProvider.core_attention = lambda self: VarlenAttention


# name -> (patch, condition). Conditions: "always" (feature-detected fixes, safe on any version),
# "cpu" (megatron-core 0.16.1 on a machine without CUDA; version-pinned), "gloo" (collectives on
# a gloo process group), "torch_norm_sp" (sequence parallelism with megatron's torch norm, i.e.
# the local layer spec without Apex: CPU, or a GPU without Apex - a TP>1 MoE trainer).
_PATCHES: list[tuple[str, Callable[[], None], str]] = [
    ("moe_te_general_gemm", _patch_moe_te_general_gemm, "always"),
    ("varlen_attention", _patch_varlen_attention, "always"),
    ("cuda_current_device", cpu.patch_cuda_current_device, "cpu"),
    ("cuda_streams", cpu.patch_cuda_streams, "cpu"),
    ("cuda_rng", cpu.patch_cuda_rng, "cpu"),
    ("default_causal_mask", cpu.patch_default_causal_mask, "cpu"),
    ("schedule_token_count", cpu.patch_schedule_token_count, "cpu"),
    ("moe_split_sizes", cpu.patch_moe_split_sizes, "gloo"),
    ("gloo_uneven_gather_scatter", cpu.patch_gloo_uneven_gather_scatter, "gloo"),
    ("torch_norm_sequence_parallel", _patch_torch_norm_sequence_parallel, "torch_norm_sp"),
]


TORCH_NORM = "WrappedTorchNorm"
"""Class name of megatron's torch norm, the one that asserts ``not sequence_parallel``."""


def select_patches(device: str, sequence_parallel: bool, norm: str = TORCH_NORM) -> list[str]:
    """Names of the patches a trainer on ``device`` ("cpu" or "cuda") needs; pure (applies
    nothing), so which patches a GPU layout would get can be checked on a CPU machine. ``norm``:
    the class name of the norm the layer spec uses (what the model is built with, not which
    packages are importable: NGC images ship Apex, yet the local spec's RMSNorm is torch's).

    The backend follows the device (gloo on CPU, NCCL on CUDA). Example: a TP=2 MoE trainer on a
    GPU (sequence parallelism on, local spec: WrappedTorchNorm) gets ``["moe_te_general_gemm",
    "varlen_attention", "torch_norm_sequence_parallel"]``; the same layout on CPU gets all ten.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    wanted = {"always": True, "cpu": device == "cpu", "gloo": device == "cpu",
              "torch_norm_sp": sequence_parallel and norm == TORCH_NORM}
    return [name for name, _, condition in _PATCHES if wanted[condition]]


def apply_patches(device: str | None = None, sequence_parallel: bool = True, norm: str = TORCH_NORM) -> list[str]:
    """Apply the patches ``select_patches`` names for this machine and layout; return every
    patch applied in this process so far. Idempotent: a patch is applied at most once.

    ``device`` None: "cuda" when CUDA is available, else "cpu". On CPU the installed
    megatron-core must be ``TARGET_VERSION``; otherwise ``RuntimeError`` is raised before anything
    is changed.
    """
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and _megatron_version() != TARGET_VERSION:
        raise RuntimeError(
            f"megatron_patches targets megatron-core {TARGET_VERSION} for CPU, but "
            f"{_megatron_version()} is installed; re-check each patch in megatron_patches/ against it")
    names = select_patches(device, sequence_parallel, norm)
    for name, patch, _ in _PATCHES:
        if name in names and name not in _applied:
            patch()
            _applied.append(name)
    return list(_applied)


def applied_patches() -> list[str]:
    """Names of the patches applied in this process (empty before ``apply_patches``)."""
    return list(_applied)
