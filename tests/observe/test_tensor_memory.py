"""TensorMemory (pipeline.observe.tensor_memory) against allocations whose sizes are known by
arithmetic: new storages, views, in-place ops, frees, growth, an autograd step and nesting."""
from __future__ import annotations

import gc

import torch

from pipeline.observe.tensor_memory import TensorMemory


def test_counts_new_storages_not_views_and_subtracts_frees():
    with TensorMemory() as mem:
        a = torch.zeros(1024)  # 4096 B
        b = a.view(32, 32)  # a view: no new bytes
        a.add_(1.0)  # in place: no new bytes
        assert mem.current_bytes == 4096
        c = torch.ones(256, dtype=torch.float64)  # 2048 B
        assert mem.current_bytes == 6144
        del a, b
        gc.collect()
        assert mem.current_bytes == 2048
        d = torch.empty(10, dtype=torch.int8)  # 10 B
    assert mem.peak_bytes == 6144
    assert mem.current_bytes == 2048 + 10
    assert {(1024,), (32, 32), (256,), (10,)} <= mem.shapes
    del c, d


def test_storages_from_before_entry_are_not_counted():
    before = torch.zeros(1000)
    with TensorMemory() as mem:
        view = before[:10]
        before.mul_(2.0)
        del before, view  # freeing a storage made outside does not go below zero
        gc.collect()
        assert mem.current_bytes == 0
        x = torch.zeros(8, 8)  # 256 B
    assert (mem.peak_bytes, mem.current_bytes) == (256, 256)
    del x


def test_matmul_result_shape_and_bytes():
    a, b = torch.randn(64, 16), torch.randn(16, 64)
    with TensorMemory() as mem:
        s = a @ b  # 64 x 64 fp32 = 16384 B
        del s
        gc.collect()
    assert (64, 64) in mem.shapes
    assert mem.peak_bytes == 16384
    assert mem.current_bytes == 0


def test_resize_counts_the_new_size():
    with TensorMemory() as mem:
        t = torch.empty(4)  # 16 B
        t.resize_(100)  # grows in place to 400 B
    assert mem.current_bytes == 400
    assert mem.peak_bytes == 400
    del t


def test_backward_saved_tensors_and_gradients_are_counted():
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32)
    with TensorMemory() as mem:
        y = (x @ w).tanh()  # y: 8x32 fp32 = 1024 B (x@w output is tanh's input, 1024 B, freed later)
        y.sum().backward()
        del y
        gc.collect()
        live = mem.current_bytes
    assert w.grad is not None and w.grad.shape == (32, 32)
    assert live == 32 * 32 * 4  # only the gradient (4096 B) outlives the step
    assert mem.peak_bytes >= 4096 + 1024


def test_nested_modes_each_count_their_own_block():
    with TensorMemory() as outer:
        a = torch.zeros(100)  # 400 B
        with TensorMemory() as inner:
            b = torch.zeros(50)  # 200 B
        assert inner.peak_bytes == 200
    assert outer.peak_bytes == 600
    del a, b
