"""Hugging Face exports of a trained policy: from live trainer ranks, or from a run's checkpoint.

``tokenflow export RUN [--step K] [--out DIR]`` (`pipeline.apps.export`) writes ``RUN/export/step-K/``
(default: the newest complete checkpoint) from ``RUN/checkpoints/step-K/`` without starting a trainer; the end of a
run (and, with ``trainer.export=checkpoints``, every checkpoint) writes the same directory from
the live ranks. The result is a Hugging Face checkpoint directory: ``model-r*.safetensors`` with
``model.safetensors.index.json``, ``config.json`` and the tokenizer of the model the run started
from, so transformers, vLLM, ``model.name=RUN/export/step-K`` and ``tokenflow replay`` take it.

Invariants:
- Nothing gathers the whole model on one rank or in one process: live, every rank writes the
  tensors it owns (``hf_shards``); offline, the checkpoint's files are converted one at a time.
- Tensors are stored in the model's Hugging Face dtype (``config.json``'s ``dtype``): float32
  tiny models export bit-identical to the checkpoint; bfloat16 ones round once, as transformers'
  ``save_pretrained`` would.
- A directory is complete when its ``config.json`` exists: it is written last.
- A LoRA run (``trainer.lora.rank > 0``) exports a PEFT adapter directory instead
  (``pipeline.trainer.peft_format``: ``adapter_config.json``, written last, and
  ``adapter_model.safetensors``) naming its base checkpoint in ``base_model_name_or_path``.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .conversion import hf_dtype

TOKENIZER_FILES = ("special_tokens_map.json", "generation_config.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")


def copy_tokenizer(source_dir: Path, out: Path) -> None:
    """Copy the tokenizer and generation files of a Hugging Face directory into ``out``."""
    for f in Path(source_dir).iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in TOKENIZER_FILES):
            shutil.copy2(f, Path(out) / f.name)


def finish_directory(out: Path, hf_config, source_dir: Path | None) -> None:
    """Tokenizer and generation files from ``source_dir``, then ``config.json`` (last)."""
    if source_dir is not None:
        copy_tokenizer(source_dir, out)
    hf_config.save_pretrained(str(out))


def export_live(trainer, out_dir: Path) -> Path | None:
    """Write the trainer's current weights as a Hugging Face directory (collective; every rank
    writes its own tensors). Returns the directory on world rank 0, None elsewhere."""
    import torch

    from .hf_shards import write_tensor_set

    out = Path(out_dir)
    if trainer.lora is not None:
        return _export_live_adapters(trainer, out)
    if torch.distributed.get_rank() == 0 and (out / "config.json").exists():
        (out / "config.json").unlink()
    write_tensor_set(trainer.model, trainer.hf_config, out, "model", lambda n, p: p,
                     dtype=hf_dtype(trainer.hf_config))
    if torch.distributed.get_rank() != 0:
        return None
    finish_directory(out, trainer.hf_config, Path(trainer.cfg.model_dir))
    return out


def _export_live_adapters(trainer, out: Path) -> Path | None:
    """A LoRA trainer's export: a PEFT adapter directory (collective; rank 0 writes it)."""
    from .model import iter_hf_weights
    from .peft_format import write_peft_dir

    adapters = dict(iter_hf_weights(trainer.model, trainer.hf_config))  # adapters only, small
    if not adapters:
        return None
    c = trainer.lora.cfg
    return write_peft_dir(out, adapters, trainer.hf_config, c.rank, c.alpha,
                          str(Path(trainer.cfg.model_dir).resolve()))


def export_checkpoint(checkpoint: Path, out: Path, source_dir: Path) -> Path:
    """Convert a trainer checkpoint's ``model`` tensor set into a Hugging Face directory (a
    LoRA checkpoint: into a PEFT adapter directory for its base)."""
    import json

    from safetensors.torch import load_file, save_file

    from .hf_shards import write_index
    from .model import load_hf_config

    hf_config = load_hf_config(source_dir)
    lora = json.loads((checkpoint / "trainer.json").read_text()).get("lora")
    if lora is not None:
        from .peft_format import write_peft_dir

        adapters = {k: v for f in sorted(checkpoint.glob("model-r*.safetensors"))
                    for k, v in load_file(str(f)).items()}
        return write_peft_dir(out, adapters, hf_config, lora["rank"], lora["alpha"], lora["base"])
    dtype = hf_dtype(hf_config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)
    for f in sorted(checkpoint.glob("model-r*.safetensors")):
        tensors = {k: v.to(dtype).contiguous() for k, v in load_file(str(f)).items()}
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    write_index(out, "model")
    finish_directory(out, hf_config, source_dir)
    return out
