"""The patches that let megatron-core 0.16.1 run without CUDA, over gloo: ``torch.cuda``'s device,
streams and RNG mapped onto the CPU, and the few collectives gloo lacks or takes differently.

`megatron_patches` chooses and applies them (conditions "cpu" and "gloo"); each function's
docstring says what it replaces, why, and the version it was written against. They replace
attributes only, and are applied at most once per process.
"""
from __future__ import annotations

import contextlib


def patch_cuda_current_device() -> None:
    """What: ``torch.cuda.current_device()`` returns ``torch.device('cpu')``.

    Why: megatron-core 0.16.1 allocates buffers with ``device=torch.cuda.current_device()`` in
    about 60 places (DDP grad buffers, all-to-all outputs, router weights); on CPU that raises.
    """
    import torch

    torch.cuda.current_device = lambda: torch.device("cpu")


class NoStream:
    """A stand-in for ``torch.cuda.Stream``/``Event``: CPU work is already ordered, so every
    synchronisation method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return NoStream()

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, NoStream)

    def __hash__(self) -> int:
        return 0


def patch_cuda_streams() -> None:
    """What: ``torch.cuda.Stream/Event/current_stream/default_stream/stream/synchronize`` become
    no-op stand-ins.

    Why: megatron-core 0.16.1 DDP (overlapped grad reduction), the MoE all-to-all dispatcher (its
    device-to-host side stream) and ``tensor.record_stream`` call these unconditionally.
    """
    import torch

    torch.cuda.Stream = NoStream
    torch.cuda.Event = NoStream
    torch.cuda.current_stream = lambda device=None: NoStream()
    torch.cuda.default_stream = lambda device=None: NoStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    original_record_stream = torch.Tensor.record_stream

    def record_stream(tensor, stream):
        if isinstance(stream, NoStream):
            return None
        return original_record_stream(tensor, stream)

    torch.Tensor.record_stream = record_stream


def patch_cuda_rng() -> None:
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


def patch_default_causal_mask() -> None:
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


def patch_schedule_token_count() -> None:
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


def patch_moe_split_sizes() -> None:
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


def patch_gloo_uneven_gather_scatter() -> None:
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
