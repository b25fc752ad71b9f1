"""`AdapterMerger` (pipeline/weights/adapters.py) on a small safetensors base: the docstring's
worked example, merges against the base (never on top of a previous merge), reset of weights a
later update leaves out, and the refusals. No engine: the vLLM side is tests/weights/test_lora_engine.py."""
from __future__ import annotations

import pytest


@pytest.fixture
def base(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.q_proj.weight": torch.eye(2),
               "model.layers.1.mlp.down_proj.weight": torch.full((2, 2), 3.0),
               "model.norm.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def _update(scaling, *pairs):
    """An adapter update: the scale, then (stem, A, B) pairs."""
    import torch

    named = [("lora.scaling", torch.tensor([scaling]))]
    for stem, a, b in pairs:
        named += [(f"{stem}.lora_A.weight", torch.as_tensor(a)), (f"{stem}.lora_B.weight", torch.as_tensor(b))]
    return named


Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.1.mlp.down_proj"


def test_worked_example_and_merges_against_the_base(base):
    import torch

    from pipeline.weights.adapters import AdapterMerger

    m = AdapterMerger(base)
    a = [[1.0, 1.0], [0.0, 0.0]]
    (name, w), = m.merged(_update(2.0, (Q, a, [[0.5, 0.0], [0.0, 0.0]])))
    assert name == Q + ".weight" and torch.equal(w, torch.tensor([[2.0, 1.0], [0.0, 1.0]]))
    again = dict(m.merged(_update(2.0, (Q, a, torch.zeros(2, 2)))))
    assert torch.equal(again[Q + ".weight"], torch.eye(2)), "B = 0 must give back the base"
    both = m.merged(_update(1.0, (DOWN, torch.ones(1, 2), torch.ones(2, 1))))
    assert [n for n, _ in both] == [Q + ".weight", DOWN + ".weight"]  # Q back to the base, layer order
    assert torch.equal(dict(both)[Q + ".weight"], torch.eye(2))
    assert torch.equal(dict(both)[DOWN + ".weight"], torch.full((2, 2), 4.0))
    assert m.base_bytes() == 2 * 4 * 4


def test_refusals(base):
    import torch

    from pipeline.weights.adapters import AdapterMerger

    m = AdapterMerger(base)
    with pytest.raises(ValueError, match="without 'lora.scaling'"):
        m.merged(_update(1.0, (Q, torch.ones(1, 2), torch.ones(2, 1)))[1:])
    with pytest.raises(ValueError, match="A without B"):
        m.merged(_update(1.0) + [(f"{Q}.lora_A.weight", torch.ones(1, 2))])
    with pytest.raises(ValueError, match="non-adapter tensor"):
        m.merged(_update(1.0) + [("model.norm.weight", torch.ones(2))])
    with pytest.raises(ValueError, match="B @ A has shape"):
        m.merged(_update(1.0, (Q, torch.ones(1, 3), torch.ones(2, 1))))
