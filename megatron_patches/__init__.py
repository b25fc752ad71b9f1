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

Patches (each function's docstring says what, why and the version), by condition:
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

import contextlib
from typing import Callable

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


def _patch_schedule_token_count() -> None:
    """What: the pipeline schedules (``pipeline_parallel.schedules``) see a ``torch`` whose
    ``zeros(..., device="cuda")`` allocates on CPU; every other name is torch's own.

    Why: megatron-core 0.16.1 hard-codes ``device="cuda"`` for the schedules' token counter
    (``total_num_tokens``), so the 1F1B schedule of a pipeline-parallel trainer fails on CPU
    before its first micro-batch.
    """
    import types

    import torch
    from megatron.core.pipeline_parallel import schedules

    class TorchOnCpu(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*size, device=None, **kwargs):
            return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)

    schedules.torch = TorchOnCpu("torch")


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


def _patch_gloo_uneven_gather_scatter() -> None:
    """What: ``tensor_parallel.mappings._gather_along_first_dim`` and
    ``_reduce_scatter_along_first_dim`` with explicit (uneven) split sizes pad every rank's piece
    to the largest split, run the equal-size collective, and cut the padding off again.

    Why: the MoE all-to-all dispatcher with expert parallelism AND tensor parallelism gathers the
    tokens each expert-TP rank received over that group (and reduce-scatters them back); the
    ranks' counts differ because routing differs. megatron-core 0.16.1 calls
    ``torch.distributed.all_gather``/``reduce_scatter`` with tensors of different sizes, which
    NCCL accepts and gloo refuses (``invalid tensor size ... expected (688, 256), got (600, 256)``).
    Padding rows are zeros and are dropped before anything reads them, so values are unchanged
    bit for bit. Worked example, splits [3, 1] on 2 ranks: rank 1 sends [x, 0, 0]; the gathered
    [6, H] tensor keeps rows 0..2 and 3, giving the [4, H] result NCCL would have produced.
    """
    import torch
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_padded(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        most = max(sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((most * len(sizes), *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([out[r * most: r * most + n] for r, n in enumerate(sizes)])

    def scatter_padded(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(s) for s in input_split_sizes]
        most = max(sizes)
        padded = input_.new_zeros((most * len(sizes), *input_.shape[1:]))
        for r, piece in enumerate(torch.split(input_, sizes, dim=0)):
            padded[r * most: r * most + piece.shape[0]] = piece
        out = input_.new_empty((most, *input_.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, padded, group=group)
        return out[: sizes[group.rank()]].contiguous()

    mappings._gather_along_first_dim = gather_padded
    mappings._reduce_scatter_along_first_dim = scatter_padded


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
    ("cuda_current_device", _patch_cuda_current_device, "cpu"),
    ("cuda_streams", _patch_cuda_streams, "cpu"),
    ("cuda_rng", _patch_cuda_rng, "cpu"),
    ("default_causal_mask", _patch_default_causal_mask, "cpu"),
    ("schedule_token_count", _patch_schedule_token_count, "cpu"),
    ("moe_split_sizes", _patch_moe_split_sizes, "gloo"),
    ("gloo_uneven_gather_scatter", _patch_gloo_uneven_gather_scatter, "gloo"),
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
