"""Models without a hub: tokenizer, tiny checkpoints (cache, atomicity, architecture), resolve_model, vLLM load."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.models.cache import build_once
from pipeline.models.tiny import TinyModelSpec, ensure_tiny_model, resolve_model, tiny_config, tiny_spec
from pipeline.models.tokenizer import CHAT_TEMPLATE, IM_END, IM_START, PAD, load_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def dense_dir(models_root):
    return ensure_tiny_model("dense", root=models_root)


@pytest.fixture(scope="module")
def moe_dir(models_root):
    return ensure_tiny_model("moe", root=models_root)


# ---------------------------------------------------------------- tokenizer

@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_tokenizer_round_trips_any_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_tokenizer_special_ids_and_digit_tokens(tokenizer):
    assert [tokenizer.convert_tokens_to_ids(t) for t in (IM_START, IM_END, PAD)] == [0, 1, 2]
    assert tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 2
    assert 256 < len(tokenizer) <= 1024
    # every digit is its own token, so 12345 is five tokens
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("12345", add_special_tokens=False)) == list("12345")


def test_chat_template_renders_qwen_style(tokenizer):
    msgs = [{"role": "user", "content": "37+48="}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n37+48=<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    assert ids[0] == 0 and ids.count(1) == 1 and tokenizer.decode(ids) == text
    full = tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": "85"}], tokenize=False)
    assert full == text + "85<|im_end|>\n"


def test_tokenizer_training_is_deterministic(tmp_path, tokenizer):
    tokenizer.save_pretrained(str(tmp_path / "a"))
    train_tokenizer().save_pretrained(str(tmp_path / "b"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert CHAT_TEMPLATE in (tmp_path / "a" / "chat_template.jinja").read_text()


# ---------------------------------------------------------------- tiny checkpoints

def test_tiny_checkpoint_files_and_cache_reuse(models_root, dense_dir):
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (dense_dir / name).is_file(), name
    mtime = (dense_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model("dense", root=models_root) == dense_dir
    assert (dense_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert json.loads((dense_dir / "generation_config.json").read_text())["eos_token_id"] == 1
    assert not [p for p in models_root.iterdir() if ".tmp-" in p.name], "temporary build dirs left behind"


def test_spec_change_makes_a_new_directory_and_weights_are_seeded(models_root, dense_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    other = ensure_tiny_model(root=models_root, spec=TinyModelSpec(kind="dense", seed=1))
    assert other != dense_dir and other.parent == dense_dir.parent
    again = ensure_tiny_model("dense", root=tmp_path)  # same spec, fresh cache: identical weights
    assert again.name == dense_dir.name
    a, b, c = (load_file(str(d / "model.safetensors")) for d in (dense_dir, again, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_dense_architecture_loads_in_transformers(dense_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(dense_dir))
    cfg = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert 128 <= cfg.hidden_size <= 256 and 2 <= cfg.num_hidden_layers <= 4
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2) and 32 <= cfg.head_dim <= 64
    assert not cfg.tie_word_embeddings
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    tok = AutoTokenizer.from_pretrained(str(dense_dir))
    assert len(tok) <= cfg.vocab_size
    ids = tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                  return_tensors="pt")["input_ids"]
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(logits).all()


def test_moe_architecture_every_layer_routes_top2_of_at_least_4(moe_dir):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(moe_dir))
    cfg = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert cfg.num_experts >= 4 and cfg.num_experts_per_tok == 2 and not cfg.tie_word_embeddings
    assert cfg.mlp_only_layers == [] and cfg.decoder_sparse_step == 1
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers)
    # the checkpoint stores experts one by one (the layout vLLM's loader expects)
    with safe_open(str(moe_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for layer in range(cfg.num_hidden_layers):
        for e in range(cfg.num_experts):
            assert f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight" in names
    out = model(input_ids=torch.tensor([[0, 5, 6, 7]]))
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "tiny-moe8"])
def test_tiny_config_has_the_transformers_configs_fields(name, models_root):
    """The cached fields equal transformers' own config of the spec (every field, the MoE's aliased
    ``num_experts`` left to getattr's default as on any saved config); read without transformers."""
    spec = tiny_spec(name)
    hf = spec.hf_config()
    saved = tiny_config(spec, models_root)
    assert saved.to_dict() == json.loads(hf.to_json_string(use_diff=False))
    for field in ("model_type", "architectures", "num_hidden_layers", "num_key_value_heads", "hidden_size",
                  "max_position_embeddings", "rope_parameters", "vocab_size", "tie_word_embeddings"):
        assert getattr(saved, field) == getattr(hf, field), field
    assert str(saved.dtype) == str(hf.dtype).removeprefix("torch.")
    assert getattr(saved, "head_dim", None) == getattr(hf, "head_dim", None)
    assert tiny_config(spec, models_root).to_dict() == saved.to_dict()  # the second read is the cached file
    code = (f"import sys; from pipeline.models.tiny import tiny_config, tiny_spec; "
            f"tiny_config(tiny_spec({name!r}), {str(models_root)!r}); "
            f"assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_load_tokenizer_equals_auto_tokenizer_without_torch(dense_dir):
    """The orchestrator's tokenizer: the class, ids and chat template AutoTokenizer gives, no torch."""
    from transformers import AutoTokenizer

    mine, auto = load_tokenizer(dense_dir), AutoTokenizer.from_pretrained(str(dense_dir))
    assert type(mine) is type(auto)
    chat = [{"role": "user", "content": "37+48="}]
    assert mine.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    text = "sort 3 1 2 -> 1 2 3 \\boxed{7} ünï"
    assert mine(text)["input_ids"] == auto(text)["input_ids"]
    assert (mine.eos_token_id, mine.pad_token_id, mine.padding_side) == \
        (auto.eos_token_id, auto.pad_token_id, auto.padding_side)
    code = (f"import sys; from pipeline.models.tokenizer import load_tokenizer; load_tokenizer({str(dense_dir)!r}); "
            f"assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _build_slowly(root: str, log: str) -> str:
    def build(out: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        (out / "part1").write_text("x")
        time.sleep(0.5)  # others must wait, not see a half-built directory
        (out / "part2").write_text("y")

    path = build_once(Path(root), "entry", build)
    assert (path / "part2").is_file()
    return str(path)


def test_build_once_is_atomic_across_processes(tmp_path):
    log = tmp_path / "builds.log"
    with mp.get_context("fork").Pool(4) as pool:
        paths = pool.starmap(_build_slowly, [(str(tmp_path / "cache"), str(log))] * 4)
    assert len(set(paths)) == 1
    assert len(log.read_text().split()) == 1, "more than one process built the entry"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".entry.lock", "entry"]


def test_failed_build_leaves_nothing(tmp_path):
    def broken(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_once(tmp_path, "entry", broken)
    assert [p.name for p in tmp_path.iterdir()] == [".entry.lock"]


# ---------------------------------------------------------------- resolve_model

def test_resolve_model_names_and_paths(models_root, dense_dir, tmp_path):
    assert resolve_model("tiny-dense", root=models_root) == dense_dir
    assert resolve_model(str(dense_dir)) == dense_dir
    with pytest.raises(FileNotFoundError, match="neither 'tiny-dense'"):
        resolve_model("gpt-17")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="'bert' is not supported"):
        resolve_model(empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        resolve_model(empty)


# ---------------------------------------------------------------- vLLM

_VLLM_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    def main():
        from vllm import LLM, SamplingParams
        llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=128, seed=0)
        tok = llm.get_tokenizer()
        ids = tok.apply_chat_template([{"role": "user", "content": "37+48="}], add_generation_prompt=True)
        ids = list(ids["input_ids"]) if not isinstance(ids, list) else ids
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=6, temperature=1.0, logprobs=0))
        o = out[0].outputs[0]
        print("RESULT " + json.dumps({"n": len(o.token_ids), "logprobs": len(o.logprobs),
                                      "arch": llm.llm_engine.model_config.architectures}))

    if __name__ == "__main__":
        main()
""")


@pytest.mark.engine
@pytest.mark.slow  # 50 s a model; every engine test of the default suite loads and generates with both
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_vllm_loads_and_generates(kind, models_root, tmp_path):
    model_dir = ensure_tiny_model(kind, root=models_root)
    script = tmp_path / "serve.py"
    script.write_text(_VLLM_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(model_dir)], capture_output=True, text=True,
                          timeout=300, cwd=str(REPO))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert 1 <= result["n"] <= 6 and result["logprobs"] == result["n"]
    assert result["arch"] == [{"dense": "Qwen3ForCausalLM", "moe": "Qwen3MoeForCausalLM"}[kind]]
