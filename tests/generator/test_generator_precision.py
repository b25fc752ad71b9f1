"""The generator's precision and engine plan, decided before anything starts (no engine here):

- ``generator.dtype: auto`` becomes the checkpoint's dtype (vLLM's own 'auto' runs a float32
  checkpoint in bfloat16), so the demo's generator runs at the trainer's precision, and the KV cache
  is sized at that width;
- vLLM's per-tensor cast warning is logged once per process, with its count;
- `engine_plan`: the runner, compilation and routing capture of each platform (the rules of
  vLLM 0.32's ``use_v2_model_runner`` and CPU platform).

The engine side: tests/test_routing_capture_engine.py (a compiled engine), tests/test_train_e2e.py
(step-0 mismatch of the default demo), tests/test_data.py (the demo's resolved dtype)."""
from __future__ import annotations

import logging

import pytest

from pipeline.generator.config import GeneratorConfig
from pipeline.generator.engine_plan import engine_plan
from pipeline.models.defaults import checkpoint_dtype, kv_bytes_per_token, model_config
from pipeline.models.tiny import tiny_spec


def test_auto_is_the_checkpoints_dtype_and_sizes_the_kv_cache_at_it():
    hf = model_config("tiny-moe")
    per_token_f32 = kv_bytes_per_token(hf, "auto")
    assert checkpoint_dtype(hf) == "float32" and per_token_f32 == kv_bytes_per_token(hf, "float32")
    hf.dtype = "bfloat16"  # a bfloat16 checkpoint: its KV cache takes half the bytes
    assert checkpoint_dtype(hf) == "bfloat16" and kv_bytes_per_token(hf, "auto") * 2 == per_token_f32
    with pytest.raises(ValueError, match="generator.dtype='fp8'"):
        kv_bytes_per_token(hf, "fp8")


def test_an_engine_built_without_the_run_config_gets_the_checkpoints_dtype_too(tmp_path):
    from pipeline.generator.vllm_args import engine_dtype

    hf = tiny_spec("tiny-moe").hf_config()  # a transformers config, saved as a checkpoint's
    for named in ("float32", "bfloat16"):
        hf.dtype = named
        hf.save_pretrained(tmp_path / named)
        assert engine_dtype(GeneratorConfig(model=str(tmp_path / named))) == named
    assert engine_dtype(GeneratorConfig(model=str(tmp_path / "float32"), dtype="bfloat16")) == "bfloat16"


def test_vllms_cast_warning_is_logged_once_with_its_count(caplog):
    from pipeline.generator.cast_log import VLLM_CAST_LOGGER, casts_logged_once

    vllm_log, ours = logging.getLogger(VLLM_CAST_LOGGER), logging.getLogger("tokenflow.test")
    caplog.set_level(logging.INFO)
    for _ in range(3):  # three updates of 4 float32 tensors into a bfloat16 engine
        with casts_logged_once(ours):
            for name in ("a", "b", "c", "d"):
                vllm_log.warning("Attempted to load weight %s with dtype %s into parameter with dtype %s",
                                 name, "torch.float32", "torch.bfloat16")
            vllm_log.warning("something else")
    vllm_log.warning("Attempted to load weight outside a load")
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "Attempted" in m] == [
        "4 tensors of this update were cast to the engine's dtype (first: Attempted to load weight a with "
        "dtype torch.float32 into parameter with dtype torch.bfloat16); later updates cast the same way "
        "without a log line", "Attempted to load weight outside a load"]
    assert messages.count("something else") == 3


@pytest.mark.parametrize("platform,triton,eager,want", [
    ("cpu", False, False, ("v1", "torch.compile", "hook", False)),
    ("cpu", False, True, ("v1", "eager", "hook", False)),
    ("cpu", True, False, ("v2", "torch.compile", "vllm", True)),
    ("cuda", True, False, ("v2", "torch.compile + CUDA graphs", "vllm", True)),
    ("cuda", False, False, ("v1", "eager", "hook", False)),  # CUDA graphs would skip the hook
])
def test_engine_plan_picks_the_routing_capture_the_runner_and_compilation_allow(platform, triton, eager, want,
                                                                                monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    cfg = GeneratorConfig(model="m", record_routing=True, enforce_eager=eager)
    plan = engine_plan(cfg, platform, triton)
    assert (plan.runner, plan.compilation, plan.routing_capture, plan.prefix_caching) == want
    off = engine_plan(GeneratorConfig(model="m", enforce_eager=eager), platform, triton)
    assert off.routing_capture == "off" and off.prefix_caching and off.enforce_eager == eager


def test_engine_plan_follows_vllms_runner_switch_and_refuses_v2_routing_without_prefix_caching(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert engine_plan(GeneratorConfig(model="m", record_routing=True), "cuda", True).runner == "v1"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="prefix_caching=true"):
        engine_plan(GeneratorConfig(model="m", record_routing=True, prefix_caching=False), "cpu", False)
