"""vLLM's in-place layerwise reload broken off half-way, and `put_back_unfinished_modules`
(pipeline/generator/interrupted_reload.py), on a small torch model without an engine: vLLM's own
reload functions move the modules to meta and load them; the references are the tensors given."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
layerwise = pytest.importorskip("vllm.model_executor.model_loader.reload.layerwise")


class Rotary(torch.nn.Module):
    """A module with a buffer and no weights, like vLLM's rotary embedding (``cos_sin_cache``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.arange(8, dtype=torch.float32), persistent=False)


def _row_loader(param: "torch.Tensor", loaded: "torch.Tensor", row: int) -> None:
    """Loads one row, as vLLM's fused q/k/v and gate/up loaders load one shard of their parameter."""
    param.data[row].copy_(loaded)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 3, bias=False)
        self.fused = torch.nn.Linear(3, 2, bias=False)  # loaded row by row
        self.fused.weight.weight_loader = _row_loader
        self.norm = torch.nn.Linear(2, 2, bias=False)
        self.rotary = Rotary()


def _load(model: Tiny, name: str, value: "torch.Tensor") -> None:
    """What a model's load_weights does per tensor: the parameter's (wrapped) weight loader."""
    param = model.get_parameter(name)
    loader = layerwise._get_weight_loader(param)
    if name == "fused.weight":
        for row in range(value.shape[0]):
            loader(param, value[row], row)
    else:
        loader(param, value)


def _weights(seed: int) -> dict[str, "torch.Tensor"]:
    g = torch.Generator().manual_seed(seed)
    model = Tiny()
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_a_broken_reload_is_put_back_and_the_next_complete_one_loads_every_tensor():
    from pipeline.generator.interrupted_reload import put_back_unfinished_modules, tensors_without_data

    model = Tiny()
    layerwise.record_metadata_for_reloading(model)
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    old_fused = model.fused.weight
    new, newer = _weights(1), _weights(2)

    layerwise.initialize_layerwise_reload(model)
    _load(model, "first.weight", new["first.weight"])  # `first` complete: written into its live tensor
    param = model.fused.weight
    layerwise._get_weight_loader(param)(param, new["fused.weight"][0], 0)  # half of `fused`: held
    # the weights iterator raises here: vLLM's final pass never runs
    assert set(tensors_without_data(model)) == {"fused.weight", "norm.weight", "rotary.cos_sin_cache"}

    assert put_back_unfinished_modules(model) == ["fused", "norm", "rotary"]
    assert tensors_without_data(model) == []
    assert torch.equal(model.first.weight, new["first.weight"])  # completed: the new version
    assert model.fused.weight is old_fused and torch.equal(model.fused.weight, old["fused.weight"])
    assert torch.equal(model.norm.weight, old["norm.weight"])
    assert torch.equal(model.rotary.cos_sin_cache, torch.arange(8, dtype=torch.float32))
    assert "cos_sin_cache" not in model.rotary.state_dict()  # still non-persistent

    # the next complete reload: every module loads exactly the tensors given (without the reset, the
    # held half of `fused` counts towards it: the module is finished after its new row 0, its row 1
    # is dropped as an excess load and left as uninitialised memory)
    layerwise.initialize_layerwise_reload(model)
    for name, value in newer.items():
        _load(model, name, value)
    layerwise.finalize_layerwise_reload(model, None)
    assert tensors_without_data(model) == []
    for name, value in newer.items():
        assert torch.equal(model.get_parameter(name), value), name
    assert torch.equal(model.rotary.cos_sin_cache, torch.arange(8, dtype=torch.float32))
