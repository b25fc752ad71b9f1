"""Live tensor bytes inside a block of code, counted at the dispatcher (RSS is not enough).

`TensorMemory` is a ``TorchDispatchMode``: every operator that runs inside it reports its outputs;
an output whose storage was not an input's storage and is not yet counted is a new storage, and its
bytes are added to ``current_bytes``. A ``weakref.finalize`` on the storage subtracts them when the
storage is freed (torch keeps one Python object per storage, so the finalizer fires exactly when the
last tensor or view over it dies). Storages created before entry are never counted, so the figures
are *above entry*:

- ``current_bytes``: bytes of storages created inside and still alive;
- ``peak_bytes``: the largest ``current_bytes`` seen (a storage that grows in place, e.g. ``resize_``,
  counts its new size);
- ``shapes``: the shape (a tuple) of every tensor an operator produced inside, views included, so a
  caller can assert that no ``S x S`` tensor was made.

Worked example: inside the block ``a = torch.zeros(1024)`` (fp32: 4096 B), ``b = a.view(32, 32)``
(a view: 0 B more), ``del a, b`` (freed), ``c = torch.ones(256, dtype=torch.float64)`` (2048 B):
``peak_bytes == 4096``, ``current_bytes == 2048``, ``(32, 32) in shapes``.

Only what passes the dispatcher counts: allocator slack and kernel scratch space are not seen, and
the autograd graph's saved tensors are counted as the storages they are. Nesting works (each mode
counts its own block); the counts are thread-safe (finalizers may run on any thread).
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMemory(TorchDispatchMode):
    """Sums the bytes of tensor storages created and still alive inside a ``with`` block."""

    def __init__(self):
        super().__init__()
        self.current_bytes = 0  # bytes of storages created inside this block and still alive
        self.peak_bytes = 0  # the largest current_bytes seen since entry
        self.shapes: set[tuple[int, ...]] = set()  # shape of every tensor an operator produced inside
        self._counted: dict[int, int] = {}  # storage key -> bytes counted for it
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if _is_real(t)}
        for tensor in tree_leaves(out):
            if not _is_real(tensor):
                continue
            self.shapes.add(tuple(tensor.shape))
            storage = tensor.untyped_storage()
            key = _storage_key(tensor)
            with self._lock:
                if key in self._counted:
                    self._grow(key, storage.nbytes())
                elif key not in inputs:
                    self._counted[key] = 0
                    self._grow(key, storage.nbytes())
                    weakref.finalize(storage, self._free, key)
        return out

    def _grow(self, key: int, nbytes: int) -> None:
        """Counts ``key`` at ``nbytes`` (new or resized); the caller holds the lock."""
        self.current_bytes += nbytes - self._counted[key]
        self._counted[key] = nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _free(self, key: int) -> None:
        with self._lock:
            self.current_bytes -= self._counted.pop(key, 0)


def _is_real(x) -> bool:
    """A tensor with memory behind it (not meta, not a subclass wrapper without storage)."""
    return isinstance(x, torch.Tensor) and x.device.type != "meta" and not x.is_sparse


def _storage_key(tensor: torch.Tensor) -> int:
    """Identity of the storage under ``tensor`` while it lives (its StorageImpl's address)."""
    return tensor.untyped_storage()._cdata
