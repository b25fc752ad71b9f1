"""Users' data end to end without engines: the dataset task on JSONL (no cap, epochs, shuffling, split),
Python verifiers, prompt formats, the orchestrator's prompt sources and the model/task defaults."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from pipeline.config import TokenflowConfig, validate
from pipeline.models.family_checkpoints import build_family_checkpoint
from pipeline.models.tokenizer import train_tokenizer
from pipeline.tasks import DatasetTask, SortDigitsTask, TaskConfig, make_task
from pipeline.tasks.prompting import PromptFormat
from pipeline.tasks.sources import task_prompt_sources


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """30,000 rows (more than the old 20,000 cap) with a blank line in the middle."""
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    lines = [json.dumps({"prompt": f"What is {i} plus 1?", "answer": i + 1, "id": i}) for i in range(30_000)]
    lines.insert(100, "   ")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_rows_are_read_back_exactly_by_offset(big):
    task = DatasetTask(big, eval_size=50)
    reference = {}
    for lineno, line in enumerate(big.read_text().splitlines(), start=1):
        if line.strip():
            row = json.loads(line)
            reference[f"big.jsonl:{lineno}"] = (row["prompt"], str(row["answer"]))
    seen = [task.prompt_by_id(0, i) for i in (0, 99, 100, 12_345, task.train_size - 1)]
    seen += task.eval_prompts()
    assert all(reference[p.uid] == (p.text, p.answer) for p in seen)
    assert task.train_size == 30_000 - 50


def test_no_cap_an_epoch_covers_every_training_row_once_then_reshuffles(big):
    task = DatasetTask(big, eval_size=50)
    n = task.train_size
    epoch0 = [task.prompt_id(5, p) for p in range(n)]
    assert sorted(epoch0) == list(range(n))  # all 29,950 rows, not 20,000
    epoch1 = [task.prompt_id(5, p) for p in range(n, 2 * n)]
    assert sorted(epoch1) == list(range(n)) and epoch1 != epoch0
    assert epoch0 != [task.prompt_id(6, p) for p in range(n)]
    eval_texts = {p.text for p in task.eval_prompts()}
    assert not eval_texts & {task.prompt_by_id(5, i).text for i in epoch0[:5000]}


def test_order_is_a_pure_function_of_seed_and_position(big):
    """What resume relies on: a fresh task object (another process) gives the same prompt anywhere."""
    a, b = DatasetTask(big, eval_size=50), DatasetTask(big, eval_size=50)
    for position in (0, 1, 777, 29_949, 29_950, 61_000):
        assert a.prompt_by_id(3, a.prompt_id(3, position)) == b.prompt_by_id(3, b.prompt_id(3, position))
    assert [p.uid for p in itertools.islice(a.train_prompts(3), 100)] == \
        [b.prompt_by_id(3, b.prompt_id(3, i)).uid for i in range(100)]


def test_unshuffled_order_is_file_order_and_split_fields_apply(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": i} for i in range(40)]
    task = DatasetTask(_write(tmp_path / "d.jsonl", rows), shuffle=False, eval_fraction=0.1, split_seed=99)
    held = {p.text for p in task.eval_prompts()}
    assert len(held) == 4
    expected = [r["prompt"] for r in rows if r["prompt"] not in held]
    assert [task.prompt_by_id(0, task.prompt_id(0, i)).text for i in range(72)] == expected * 2
    other = DatasetTask(tmp_path / "d.jsonl", shuffle=False, eval_fraction=0.1, split_seed=100)
    assert {p.text for p in other.eval_prompts()} != held
    with pytest.raises(ValueError, match="eval_fraction"):
        DatasetTask(tmp_path / "d.jsonl", eval_fraction=1.5)


def test_python_verifier_named_in_config(tmp_path, monkeypatch):
    (tmp_path / "my_verifier.py").write_text(
        "def score(completion, answer, prompt):\n"
        "    return 1.0 if completion.strip().lower() == answer.lower() else 0.0\n"
        "def broken(completion, answer, prompt):\n"
        "    return 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write(tmp_path / "words.jsonl", [{"prompt": f"Say word {i}", "answer": f"Word{i}"} for i in range(10)])
    task = make_task(TaskConfig(name="jsonl", path=str(path), verifier="my_verifier:score"))
    p = task.eval_prompts()[0]
    assert task.score(p, f"  {p.answer.upper()} ") == 1.0 and task.score(p, "\\boxed{3}") == 0.0
    broken = make_task(TaskConfig(name="jsonl", path=str(path), verifier="my_verifier:broken"))
    with pytest.raises(ValueError, match=r"rewards must be in \[0, 1\]"):
        broken.score(p, "x")
    for spec, message in (("my_verifier", "module:function"), ("my_verifier:nope", "cannot be loaded"),
                          ("no_such_module:f", "cannot be loaded")):
        with pytest.raises(ValueError, match=f"task.verifier.*{message}"):
            make_task(TaskConfig(name="jsonl", path=str(path), verifier=spec))
    with pytest.raises(ValueError, match="task=dataset only"):
        make_task(TaskConfig(name="sort", verifier="my_verifier:score"))


# ---------------------------------------------------------------- prompt formats

THINKING_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}")


def test_system_prompt_template_kwargs_and_raw_prompts(tokenizer):
    task = SortDigitsTask()
    p = task.eval_prompts()[0]
    fmt = PromptFormat.of(TaskConfig(system_prompt="Be brief."), task)
    assert fmt.render(tokenizer, task, p) == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{p.text}"
                                              "<|im_end|>\n<|im_start|>assistant\n")
    ids = fmt.encode(tokenizer, task, p)
    assert tokenizer.decode(ids) == fmt.render(tokenizer, task, p) and ids.count(0) == 3  # three <|im_start|>
    raw = PromptFormat.of(TaskConfig(prompt_format="raw"), task)
    assert raw.encode(tokenizer, task, p) == tokenizer(p.text)["input_ids"]
    tok = train_tokenizer()  # a copy whose template takes a keyword
    tok.chat_template = THINKING_TEMPLATE
    off = PromptFormat.of(TaskConfig(chat_template_kwargs={"enable_thinking": False}), task)
    assert off.render(tok, task, p).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert PromptFormat.of(TaskConfig(), task).render(tok, task, p).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="need task.prompt_format=chat"):
        PromptFormat.of(TaskConfig(prompt_format="raw", system_prompt="x"), task)
    with pytest.raises(ValueError, match="task.prompt_format"):
        PromptFormat.of(TaskConfig(prompt_format="markdown"), task)
    short = PromptFormat.of(TaskConfig(max_prompt_tokens=5))
    with pytest.raises(ValueError, match=r"tokens > task.max_prompt_tokens=5"):
        short.encode(tokenizer, task, p)


def test_orchestrator_sources_serve_every_group_with_the_recorded_format(big, tokenizer):
    cfg = TaskConfig(name="jsonl", path=str(big), eval_size=50, system_prompt="Answer with a number.")
    train, evals, verify, counts = task_prompt_sources(cfg, tokenizer, seed=4)
    assert counts == {"bad_rows": 0, "too_long_train": 0, "too_long_eval": 0}
    task = DatasetTask(big, eval_size=50)
    fmt = PromptFormat.of(cfg, task)
    for group in (0, 19_999, 20_000, 29_950, 45_678):  # past the old 20,000 cap and into epoch 1
        item = train.for_group(group)
        assert item.prompt_id == task.prompt_id(4, group)
        expected = task.prompt_by_id(4, item.prompt_id)
        assert item.answer == expected
        assert item.token_ids.tolist() == fmt.encode(tokenizer, task, expected)
        assert tokenizer.decode(item.token_ids).startswith("<|im_start|>system\nAnswer with a number.")
    assert len(train) == task.train_size and len(evals) == 50
    right = tokenizer.encode(f"so \\boxed{{{item.answer.answer}}}", add_special_tokens=False)
    assert verify(item, np.array(right)) == 1.0 and verify(item, np.array(right[:-2])) == 0.0
    sort_train, _, _, _ = task_prompt_sources(TaskConfig(), tokenizer, seed=4)
    again, _, _, _ = task_prompt_sources(TaskConfig(), tokenizer, seed=4)
    assert [sort_train.for_group(g).answer for g in (0, 50_000)] == [again.for_group(g).answer for g in (0, 50_000)]
    with pytest.raises(TypeError, match="no length"):
        len(sort_train)


# ---------------------------------------------------------------- defaults by model and task


def test_demo_defaults_are_the_old_demo_values():
    cfg = TokenflowConfig()
    validate(cfg)
    g = cfg.generator
    assert cfg.model.warmstart_steps == 300 and cfg.task.max_tokens == 32
    assert (g.max_tokens, g.max_num_seqs, g.enforce_eager, g.kv_cache_gib) == (32, 64, True, 1)
    assert g.max_model_len == 32 + 32
    assert g.dtype == "float32" == cfg.trainer.parallel.params_dtype  # auto: the checkpoint's, as the trainer's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_family_checkpoint("qwen2-tied", tmp_path_factory.mktemp("ckpt") / "qwen2")


def test_checkpoint_defaults_follow_the_model_and_the_task(checkpoint, tmp_path):
    data = _write(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(300)])
    cfg = TokenflowConfig()
    cfg.model.name, cfg.task = str(checkpoint), TaskConfig(name="jsonl", path=str(data), max_tokens=200)
    validate(cfg)
    g = cfg.generator
    assert cfg.model.warmstart_steps == 0
    assert (g.max_tokens, g.max_num_seqs, g.enforce_eager) == (200, 256, False)
    assert g.max_model_len == 1224  # min(max_position_embeddings 4096, max_prompt_tokens 1024 + 200)
    # K and V: 2 layers x 2 KV heads x 32 dims x 4 bytes x 2 = 1 KiB per token; 1224 x 256 -> 306 MiB -> 1 GiB
    assert g.kv_cache_gib == 1
    kept = TokenflowConfig()
    kept.model.name, kept.model.warmstart_steps = str(checkpoint), 5
    kept.task = TaskConfig(name="jsonl", path=str(data), max_tokens=100, max_prompt_tokens=50)
    kept.generator.max_num_seqs, kept.generator.enforce_eager, kept.generator.max_tokens = 8, True, 40
    validate(kept)
    assert (kept.model.warmstart_steps, kept.generator.max_num_seqs, kept.generator.enforce_eager) == (5, 8, True)
    assert (kept.generator.max_tokens, kept.generator.max_model_len) == (40, 90)


def test_defaults_refuse_what_cannot_run(checkpoint, tmp_path):
    data = _write(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(100)])
    cfg = TokenflowConfig()
    cfg.model.name, cfg.task = str(checkpoint), TaskConfig(name="jsonl", path=str(data), max_tokens=5000)
    with pytest.raises(ValueError, match=r"max_model_len \(4096\) must exceed generator.max_tokens \(5000\)"):
        validate(cfg)
    cfg = TokenflowConfig()
    cfg.task = TaskConfig(name="jsonl", path=str(data), epochs=2, max_tokens=64)  # 80 rows x 2 < 60 steps x 8
    with pytest.raises(ValueError, match=r"task.epochs=2 gives 2 x 80 training prompts.*needs 480"):
        validate(cfg)
    cfg.run.steps = 20
    validate(cfg)
    bad = TokenflowConfig()
    bad.task = TaskConfig(name="jsonl", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        validate(bad)


def test_readme_train_on_your_data_line_composes_and_resolves(checkpoint, tmp_path):
    """`tokenflow train task=jsonl task.path=data.jsonl model.name=/path/to/hf/checkpoint`, as composed by Hydra."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipeline.config import register
    from pipeline.apps.train import CONFIGS

    data = _write(tmp_path / "data.jsonl", [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(300)])
    register()
    with initialize_config_dir(str(CONFIGS), version_base=None):
        composed = compose("train", overrides=["task=jsonl", f"task.path={data}", f"model.name={checkpoint}"])
    composed.run.dir = str(tmp_path / "run")
    cfg = OmegaConf.to_object(composed)
    validate(cfg)
    g = cfg.generator
    assert cfg.model.warmstart_steps == 0 and cfg.task.max_tokens == 1024
    assert (g.max_tokens, g.max_model_len, g.max_num_seqs, g.enforce_eager) == (1024, 2048, 256, False)


def test_docs_worked_examples(tmp_path, monkeypatch):
    """The examples of docs/data.md, as written there."""
    from pipeline.tasks.math_answer import answers_match, extract_answer

    for completion, reward in (("3/4 is 6/8, plus 1/8 gives \\boxed{\\frac{7}{8}}", True),
                               ("... so the answer is 0.875", True), ("\\boxed{7/9}", False)):
        assert answers_match(extract_answer(completion), "7/8") is reward
    (tmp_path / "my_verifiers.py").write_text(
        "import re\n\n"
        "def choice(completion: str, answer: str, prompt: str) -> float:\n"
        "    letters = re.findall(r\"\\b([A-E])\\b\", completion)\n"
        "    return 1.0 if letters and letters[-1] == answer.strip().upper() else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": f"({i}) Which planet is largest? A) Mars B) Jupiter C) Venus. Answer with the letter.",
             "answer": "B"} for i in range(5)]
    task = make_task(TaskConfig(name="jsonl", path=str(_write(tmp_path / "data.jsonl", rows)),
                                eval_fraction=0.2, verifier="my_verifiers:choice"))
    p = task.eval_prompts()[0]
    assert task.score(p, "It is Jupiter, so B") == 1.0 and task.score(p, "A") == 0.0
