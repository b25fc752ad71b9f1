"""Adapter-only weight updates (LoRA): what travels, and how a generator applies it.

A LoRA trainer (``pipeline.trainer.lora``) sends only its adapters over the weight channel, with
the packing, versions and failure rules of a full update (``shards.py``, ``group.py``). The
generator merges them into the weights its engine runs: ``W = W_base + s * B @ A``, ``s = alpha / r``.

Invariants:
- An adapter update is a stream whose first tensor is ``lora.scaling`` (float32, shape [1]),
  followed by ``<weight>.lora_A.weight`` [r, in] and ``<weight>.lora_B.weight`` [out, r] for HF
  weight names ``<weight>.weight`` (per-expert names for experts: ``...experts.E.gate_proj``).
  A full update never starts with that name.
- The merge is always against the base: `AdapterMerger` keeps a float32 copy of the base weight of
  every adapted module (read once, from the base checkpoint the engine was started from), so
  version v+1 is ``base + delta(v+1)``, never ``base + delta(v) + delta(v+1)``.
- An update is the whole delta: a weight the previous update changed and this one does not
  carry goes back to its base value.
- Merged in float32, cast to the base's dtype once. A weight with only one of A and B, or with
  shapes that do not fit the base, raises naming it; nothing is loaded then.
- The merged weights are ordinary HF-named tensors: the engine's own loader puts them where its
  fused layouts want them (q/k/v into ``qkv_proj`` rows, gate/up into ``gate_up_proj``, experts
  into the packed ``w13``/``w2``), so no slice arithmetic of vLLM's layouts lives here.

Worked example (r 2, alpha 4, s 2): base ``W = [[1, 0], [0, 1]]``, ``A = [[1, 1], [0, 0]]``,
``B = [[0.5, 0], [0, 0]]``: ``B @ A = [[0.5, 0.5], [0, 0]]``, merged ``[[2, 1], [0, 1]]``; the next
update with ``B = 0`` loads ``[[1, 0], [0, 1]]`` again (the base), not ``[[2, 1], [0, 1]]``.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch

SCALING_NAME = "lora.scaling"
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


def is_adapter_update(first_name: str) -> bool:
    """True when a stream whose first tensor is named ``first_name`` is an adapter update."""
    return first_name == SCALING_NAME


def _natural(name: str) -> tuple:
    """Sort key keeping each layer's weights together, layers in numeric order: the order a full
    update has (given out of layer order, the dense engine test saw an update not take effect)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


class AdapterMerger:
    """Turns adapter updates into merged HF weights against a kept copy of the base weights."""

    def __init__(self, base_dir: str | Path):
        self.base_dir = Path(base_dir)
        self.base: dict[str, "torch.Tensor"] = {}  # HF weight name -> base weight (float32 copy)
        self.dtypes: dict[str, "torch.dtype"] = {}
        self._read = None
        self.merged_last: set[str] = set()  # weights the previous update changed

    def _base(self, name: str) -> "torch.Tensor":
        import torch

        if name not in self.base:
            if self._read is None:
                from pipeline.trainer.model import hf_tensor_reader

                self._read = hf_tensor_reader(sorted(self.base_dir.glob("*.safetensors")), str(self.base_dir))
            t = self._read(name)
            self.dtypes[name] = t.dtype
            self.base[name] = t.to(torch.float32, copy=True)
        return self.base[name]

    def merged(self, named: Iterable[tuple[str, "torch.Tensor"]]) -> list[tuple[str, "torch.Tensor"]]:
        """The merged HF weights of an adapter update (the whole update is read first: adapter
        tensors are small, and stream buffers are reused after the next bucket)."""
        import torch

        scaling, a, b = None, {}, {}
        for name, t in named:
            if name == SCALING_NAME:
                scaling = float(t.reshape(-1)[0])
            elif name.endswith(A_SUFFIX):
                a[name.removesuffix(A_SUFFIX) + ".weight"] = t.to(torch.float32, copy=True)
            elif name.endswith(B_SUFFIX):
                b[name.removesuffix(B_SUFFIX) + ".weight"] = t.to(torch.float32, copy=True)
            else:
                raise ValueError(f"adapter update carries a non-adapter tensor {name!r}")
        if scaling is None:
            raise ValueError(f"adapter update without {SCALING_NAME!r}")
        if set(a) != set(b):
            odd = sorted(set(a) ^ set(b))[:3]
            raise ValueError(f"adapter update has A without B or B without A for {odd}")
        out = []
        for name in sorted(a, key=_natural):
            w = self._base(name)
            delta = b[name] @ a[name]
            if delta.shape != w.shape:
                raise ValueError(f"{name}: B @ A has shape {tuple(delta.shape)}, the base weight "
                                 f"{tuple(w.shape)}")
            out.append((name, (w + scaling * delta).to(self.dtypes[name])))
        out += [(name, self.base[name].to(self.dtypes[name], copy=True)) for name in self.merged_last - set(a)]
        self.merged_last = set(a)
        return sorted(out, key=lambda item: _natural(item[0]))

    def base_bytes(self) -> int:
        """Bytes of the kept base copies."""
        return sum(t.numel() * t.element_size() for t in self.base.values())

