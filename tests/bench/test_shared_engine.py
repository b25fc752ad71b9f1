"""bench/shared_engine.py's engine config: widened to every benchmark's needs, refused where an engine
setting differs (the engine runs themselves: tests/bench/test_bench_smoke.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pipeline.generator.config import GeneratorConfig

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "shared_engine.py"


@pytest.fixture(scope="module")
def shared_engine():
    spec = importlib.util.spec_from_file_location("bench_shared_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_engine_takes_the_largest_needs(shared_engine):
    generator = GeneratorConfig(model="m", max_model_len=72, max_num_seqs=4, kv_cache_gib=1, ignore_eos=True)
    episodes = GeneratorConfig(model="m", max_model_len=96, max_num_seqs=2, kv_cache_gib=None, stop_token_ids=[0, 2])
    shared = shared_engine.shared_config({"generator": generator, "episodes": episodes})
    assert (shared.max_model_len, shared.max_num_seqs, shared.kv_cache_gib) == (96, 4, 1)
    assert shared.ignore_eos and shared.model == "m"  # the rest: the first benchmark's
    neither = shared_engine.shared_config({"a": GeneratorConfig(model="m"), "b": GeneratorConfig(model="m")})
    assert neither.kv_cache_gib is None and neither.max_num_seqs is None


@pytest.mark.parametrize("field, values", [("model", ("a", "b")), ("dtype", ("float32", "bfloat16")),
                                           ("record_routing", (False, True)), ("seed", (0, 3)),
                                           ("cpu_cores", ("", "0"))])
def test_an_engine_setting_that_differs_is_refused(shared_engine, field, values):
    configs = {f"bench{i}": GeneratorConfig(**{"model": "m", field: v}) for i, v in enumerate(values)}
    with pytest.raises(ValueError, match=f"generator.{field} differs"):
        shared_engine.shared_config(configs)
