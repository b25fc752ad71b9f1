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
"""
from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("special_tokens_map.json", "generation_config.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")


def hf_dtype(hf_config):
    import torch

    name = getattr(hf_config, "dtype", None)
    if isinstance(name, torch.dtype):
        return name
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(name), torch.float32)


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
    if torch.distributed.get_rank() == 0 and (out / "config.json").exists():
        (out / "config.json").unlink()
    write_tensor_set(trainer.model, trainer.hf_config, out, "model", lambda n, p: p,
                     dtype=hf_dtype(trainer.hf_config))
    if torch.distributed.get_rank() != 0:
        return None
    finish_directory(out, trainer.hf_config, Path(trainer.cfg.model_dir))
    return out


def export_checkpoint(checkpoint: Path, out: Path, source_dir: Path) -> Path:
    """Convert a trainer checkpoint's ``model`` tensor set into a Hugging Face directory."""
    from safetensors.torch import load_file, save_file

    from .hf_shards import write_index
    from .model import load_hf_config

    hf_config = load_hf_config(source_dir)
    dtype = hf_dtype(hf_config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)
    for f in sorted(checkpoint.glob("model-r*.safetensors")):
        tensors = {k: v.to(dtype).contiguous() for k, v in load_file(str(f)).items()}
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    write_index(out, "model")
    finish_directory(out, hf_config, source_dir)
    return out
