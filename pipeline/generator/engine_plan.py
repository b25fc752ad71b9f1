"""Which vLLM model runner, compilation and Keep Routing capture an engine of a `GeneratorConfig` uses,
decided before the engine starts (`engine_plan`; `tokenflow doctor` prints it, `vllm_args` applies it).

Rules (vLLM 0.32, `vllm/config/vllm.py` ``use_v2_model_runner``, `vllm/platforms/cpu.py`):
- runner: ``VLLM_USE_V2_MODEL_RUNNER`` when set, else 'v2' whenever Triton is importable, else 'v1'
  (the features that keep vLLM on V1 otherwise, speculative decoding and such, are none Tokenflow
  sets). The CPU build without Triton runs V1.
- compilation: 'eager' with ``enforce_eager``; else on CPU 'torch.compile' (Dynamo traces the model
  once, inductor compiles it) and on GPU 'torch.compile + CUDA graphs'.
- routing capture (``record_routing``): on V2, 'vllm': vLLM's own routed-experts output
  (``enable_return_routed_experts``; the capture writes into a device buffer the compiled graph and
  the CUDA graphs keep; it needs prefix caching, whose cached positions it returns from its store).
  On V1, 'hook': `pipeline.generator.routing_capture` records each router's top-k through a custom
  op; prefix caching is off (a position served from the cache is never routed). A compiled CPU engine
  is traced again once the hook is installed (its compile cache off, so the hookless graph is never
  loaded back); on GPU, CUDA graphs would replay the MoE layers without running the hook, so the
  engine runs eager.
- contradictions are refused here, naming the field: routing capture on V2 with prefix caching off.

Example: the demo's tiny MoE on this CPU machine (no Triton) with ``record_routing`` and the
checkpoint default ``enforce_eager=False``: runner v1, compilation torch.compile, capture hook,
prefix caching off. The same config on a GPU node with Triton: runner v2, torch.compile + CUDA
graphs, capture vllm, prefix caching on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.generator.config import GeneratorConfig


@dataclass(frozen=True)
class EnginePlan:
    """What an engine will run (see the module rules)."""

    platform: str
    """'cpu' or 'cuda'."""
    runner: str
    """vLLM model runner: 'v1' or 'v2'."""
    compilation: str
    """'eager', 'torch.compile' (CPU) or 'torch.compile + CUDA graphs' (GPU)."""
    routing_capture: str
    """'off', 'vllm' (vLLM's routed-experts output) or 'hook' (Tokenflow's recorder)."""
    prefix_caching: bool
    """Whether the engine shares prompt KV blocks (off under the routing hook)."""
    reason: str
    """Why the runner, and what routing capture changed (one line)."""

    @property
    def enforce_eager(self) -> bool:
        return self.compilation == "eager"


def _v2_from_env() -> bool | None:
    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    return None if value is None else value.strip().lower() in ("1", "true")


def engine_plan(config: GeneratorConfig, platform: str | None = None, triton: bool | None = None) -> EnginePlan:
    """The plan of an engine for `config` on `platform` ('cpu' or 'cuda'; None: vLLM's current
    platform) with or without Triton (None: whether vLLM finds it). ``config.enforce_eager`` must be
    resolved (pipeline.models.defaults). Raises ValueError on a contradiction."""
    if platform is None:
        from vllm.platforms import current_platform
        platform = "cpu" if current_platform.is_cpu() else "cuda"
    if triton is None:
        from vllm.triton_utils import HAS_TRITON
        triton = bool(HAS_TRITON)
    forced = _v2_from_env()
    if forced is not None:
        runner, reason = ("v2" if forced else "v1"), f"VLLM_USE_V2_MODEL_RUNNER={int(forced)}"
    else:
        runner, reason = ("v2", "Triton importable") if triton else ("v1", "no Triton")
    eager = bool(config.enforce_eager)
    capture, prefix = "off", config.prefix_caching
    if config.record_routing:
        if runner == "v2":
            capture = "vllm"
            if not prefix:
                raise ValueError("generator.record_routing on vLLM's V2 model runner uses vLLM's routed-experts "
                                 "output, which needs generator.prefix_caching=true")
            reason += "; routing: vLLM's routed-experts output"
        else:
            capture, prefix = "hook", False
            reason += "; routing: the recorder hook, prefix caching off"
            if platform != "cpu" and not eager:
                eager = True
                reason += ", eager (CUDA graphs would replay the MoE layers without running the hook)"
            elif not eager:
                reason += ", traced again with the hook installed"
    compilation = "eager" if eager else ("torch.compile" if platform == "cpu" else "torch.compile + CUDA graphs")
    return EnginePlan(platform=platform, runner=runner, compilation=compilation, routing_capture=capture,
                      prefix_caching=prefix, reason=reason)
