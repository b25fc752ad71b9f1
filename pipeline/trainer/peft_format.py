"""PEFT adapter directories: the export format of a LoRA run (``adapter_config.json`` +
``adapter_model.safetensors``, loaded by ``peft.PeftModel.from_pretrained(base, dir)``).

The trainer's adapters have HF adapter names (``pipeline.trainer.lora``): per linear weight
``<module>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r], experts per expert
(``...mlp.experts.E.gate_proj.lora_A.weight``). PEFT names them ``base_model.model.<module>.lora_X.weight``.
transformers 5 keeps a Qwen3-MoE layer's experts as two 3-D parameters, ``experts.gate_up_proj``
[E, 2I, H] and ``experts.down_proj`` [E, H, I], which PEFT adapts with ``target_parameters``: one
``lora_A`` [E*r, in] (expert e's rows ``e*r .. e*r+r-1``) and one ``lora_B`` [out, r*E] (expert e's
columns ``e, E+e, 2E+e, ...``: PEFT reshapes it to [out, r, E]). With ``target_parameters`` listed
gate_up first, PEFT nests the down_proj wrapper outside the gate_up one, so gate_up's adapters are
named ``experts.base_layer.lora_X.weight`` and down_proj's ``experts.lora_X.weight``.

Invariants: ``peft_tensors`` is a pure renaming/stacking (no arithmetic); a gate/up pair must
share its A (it is one fused adapter in the trainer), else ``ValueError``; the config's
``target_modules`` is a regex matching exactly the adapted module names, so PEFT adds no adapter
the trainer did not train. ``adapter_config.json`` is written last (it marks the directory complete).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

PREFIX = "base_model.model."
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$")


def peft_tensors(adapters: dict, hf_config) -> dict:
    """PEFT-named tensors of the trainer's HF adapter tensors (module docstring)."""
    import torch

    out, experts = {}, {}
    for name, t in adapters.items():
        if m := _EXPERT.match(name):
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3), m.group(4))] = t
        else:
            out[PREFIX + name] = t.contiguous()
    for prefix, parts in experts.items():
        n = hf_config.num_experts
        a_gu, b_gu, a_d, b_d = [], [], [], []
        for e in range(n):
            if not torch.equal(parts[(e, "gate_proj", "A")], parts[(e, "up_proj", "A")]):
                raise ValueError(f"{prefix}.{e}: gate_proj and up_proj adapters do not share lora_A")
            a_gu.append(parts[(e, "gate_proj", "A")])
            b_gu.append(torch.cat([parts[(e, "gate_proj", "B")], parts[(e, "up_proj", "B")]], 0))
            a_d.append(parts[(e, "down_proj", "A")])
            b_d.append(parts[(e, "down_proj", "B")])
        for inner, a, b in ((".base_layer", a_gu, b_gu), ("", a_d, b_d)):
            out[f"{PREFIX}{prefix}{inner}.lora_A.weight"] = torch.cat(a, 0).contiguous()
            stacked = torch.stack(b, dim=-1)  # [out, r, E]
            out[f"{PREFIX}{prefix}{inner}.lora_B.weight"] = stacked.reshape(stacked.shape[0], -1).contiguous()
    return out


def peft_config(adapters: dict, rank: int, alpha: float, base: str) -> dict:
    """``adapter_config.json`` for the adapted modules of ``adapters`` (HF adapter names)."""
    modules, params = set(), []
    for name in adapters:
        if m := _EXPERT.match(name):
            for p in (f"{m.group(1)}.gate_up_proj", f"{m.group(1)}.down_proj"):
                if p not in params:
                    params.append(p)
        else:
            modules.add(re.sub(r"\.lora_[AB]\.weight$", "", name))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "target_modules": "^(" + "|".join(re.escape(m) for m in sorted(modules)) + ")$" if modules else None,
        "target_parameters": params or None, "modules_to_save": None, "inference_mode": True,
    }
    return config


def write_peft_dir(out: Path, adapters: dict, hf_config, rank: int, alpha: float, base: str) -> Path:
    """Write ``adapters`` (HF adapter names -> tensors) as a PEFT adapter directory ``out``."""
    from safetensors.torch import save_file

    from .conversion import hf_dtype

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").unlink(missing_ok=True)
    dtype = hf_dtype(hf_config)
    tensors = {k: v.to(dtype) for k, v in peft_tensors(adapters, hf_config).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = peft_config(adapters, rank, alpha, base)
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=1))
    return out
