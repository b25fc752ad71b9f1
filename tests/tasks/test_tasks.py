"""Tasks: the built-in addition task, the math-answer verifier, the JSONL loader, the warm-start."""
from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.tasks import AdditionTask, DatasetTask, Prompt, SortDigitsTask, TaskConfig, make_task
from pipeline.tasks.math_answer import answers_match, extract_answer, parse_number

# ---------------------------------------------------------------- built-in tasks

BUILTIN = [pytest.param(SortDigitsTask, id="sort"), pytest.param(AdditionTask, id="addition")]


@pytest.mark.parametrize("cls", BUILTIN)
def test_eval_set_is_fixed_distinct_and_disjoint_from_training(cls):
    a, b = cls(), cls()
    evals = a.eval_prompts()
    assert evals == b.eval_prompts() and len(evals) == 200
    eval_texts = {p.text for p in evals}
    assert len(eval_texts) == 200
    for seed in (0, 1, 12345):
        train = list(itertools.islice(a.train_prompts(seed), 20_000))
        assert not eval_texts & {p.text for p in train}
    assert all(a.score(p, a.reference_completion(p)) == 1.0 for p in evals)


def test_training_stream_skips_held_out_prompts_in_a_small_space():
    # 1-digit addition has 100 pairs: the stream must cover the 90 training pairs and never the 10 held out
    task = AdditionTask(digits=1, eval_size=10)
    seen = {p.text for p in itertools.islice(task.train_prompts(0), 5_000)}
    assert len(seen) == 90 and not seen & {p.text for p in task.eval_prompts()}
    sort = SortDigitsTask(min_digits=2, max_digits=2, eval_size=10)
    seen = {p.text for p in itertools.islice(sort.train_prompts(0), 5_000)}
    assert len(seen) == 90 and not seen & {p.text for p in sort.eval_prompts()}


@pytest.mark.parametrize("cls", BUILTIN)
def test_training_stream_is_deterministic_per_seed(cls):
    task = cls()
    first = [p.text for p in itertools.islice(task.train_prompts(3), 50)]
    assert first == [p.text for p in itertools.islice(cls().train_prompts(3), 50)]
    assert first != [p.text for p in itertools.islice(task.train_prompts(4), 50)]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 99), st.integers(0, 99), st.integers(-5, 300))
def test_addition_verifier_is_exact(a, b, guess):
    task = AdditionTask()
    prompt = Prompt(uid=f"add:{a}+{b}", text=f"{a}+{b}=", answer=str(a + b))
    assert task.score(prompt, task.reference_completion(prompt)) == 1.0
    assert task.score(prompt, f" {a + b}<|im_end|>\n") == 1.0
    assert task.score(prompt, str(guess)) == (1.0 if guess == a + b else 0.0)
    for wrong in (f"0{a + b}", f"{a + b}.", f"{a + b} {a + b}", "", f"{a}+{b}={a + b}"):
        assert task.score(prompt, wrong) == 0.0


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789", min_size=6, max_size=8), st.text(alphabet="0123456789 ", max_size=9))
def test_sort_verifier_is_exact(digits, guess):
    task = SortDigitsTask()
    prompt = Prompt(uid=f"sort:{digits}", text=f"sort {digits}", answer="".join(sorted(digits)))
    assert task.score(prompt, task.reference_completion(prompt)) == 1.0
    assert task.score(prompt, f"\n{prompt.answer} <|im_end|>") == 1.0
    assert task.score(prompt, guess) == (1.0 if guess.strip() == "".join(sorted(digits)) else 0.0)
    for wrong in (" ".join(prompt.answer), prompt.answer[1:], prompt.answer + "0", f"sort {prompt.answer}"):
        assert task.score(prompt, wrong) == 0.0
    distractor = task.distractor_completion(prompt)
    assert distractor is None if len(set(digits)) == 1 else task.score(prompt, distractor) == 0.0


def test_builtin_tasks_reject_bad_arguments():
    with pytest.raises(ValueError, match="digits"):
        AdditionTask(digits=0)
    with pytest.raises(ValueError, match="eval_size"):
        AdditionTask(digits=1, eval_size=60)
    with pytest.raises(ValueError, match="min_digits"):
        SortDigitsTask(min_digits=5, max_digits=4)
    with pytest.raises(ValueError, match="eval_size"):
        SortDigitsTask(min_digits=2, max_digits=2, eval_size=11)


def test_messages_are_one_user_turn():
    task = SortDigitsTask()
    p = task.eval_prompts()[0]
    assert task.messages(p) == [{"role": "user", "content": p.text}]


# ---------------------------------------------------------------- math answers


@settings(max_examples=300, deadline=None)
@given(st.integers(-10**7, 10**7))
def test_integer_answers_in_every_spelling(n):
    for spelling in (str(n), f"{n}.0", f"{n:,}", f"${n}$", f"{2 * n}/2", f"\\frac{{{n}}}{{1}}"):
        assert answers_match(spelling, str(n)), spelling
    assert not answers_match(str(n + 1), str(n))
    assert not answers_match(f"{n}.01", str(n))
    assert extract_answer(f"First 3, then {n + 7}. So \\boxed{{{n}}}.") == str(n)
    assert extract_answer(f"the total is {n}") == str(n)


@settings(max_examples=200, deadline=None)
@given(st.integers(-999, 999), st.integers(1, 999))
def test_fraction_answers_compare_exactly(p, q):
    value = Fraction(p, q)
    assert parse_number(f"{p}/{q}") == value
    assert answers_match(f"\\frac{{{p * 3}}}{{{q * 3}}}", f"{p}/{q}")
    assert not answers_match(f"{p + 1}/{q}", f"{p}/{q}")
    if q in (1, 2, 4, 5, 8, 10, 20, 25, 50, 100):
        assert answers_match(str(float(value)), f"{p}/{q}")


def test_answer_extraction_edge_cases():
    assert extract_answer("no number here") is None
    assert extract_answer("\\boxed{\\frac{1}{2}} and later 7") == "\\frac{1}{2}"
    assert extract_answer("unclosed \\boxed{3") == "3"
    assert answers_match("x = 3", "x=3") and not answers_match("x=3", "x=4")
    assert parse_number("1/0") is None and parse_number("1,00") is None


# ---------------------------------------------------------------- JSONL


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"answer": "3"}', "'prompt' is missing"),
    ('{"prompt": "1+2?"}', "'answer' is missing"),
    ('{"prompt": "  ", "answer": "3"}', "'prompt' must be a non-empty string"),
    ('{"prompt": "1+2?", "answer": true}', "'answer' must be a string or a number"),
    ('{"prompt": "1+2?", "answer": ["3"]}', "'answer' must be a string or a number"),
    ('{"prompt": "1+2?", "answer": " "}', "'answer' is empty"),
])
def test_jsonl_bad_rows_name_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "data.jsonl", ['{"prompt": "1+1?", "answer": 2}', "", line])
    with pytest.raises(ValueError) as err:
        DatasetTask(path)
    assert f"data.jsonl:3: {message}" in str(err.value)


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        DatasetTask(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no valid rows"):
        DatasetTask(_write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(ValueError, match="too few"):
        DatasetTask(_write(tmp_path / "few.jsonl", ['{"prompt": "a", "answer": 1}'] * 3))


def _rows(n):
    return [json.dumps({"prompt": f"What is {i} times 3?", "answer": 3 * i}) for i in range(n)]


def test_jsonl_split_is_fixed_and_disjoint(tmp_path):
    path = _write(tmp_path / "d.jsonl", _rows(50))
    task = DatasetTask(path)
    evals = task.eval_prompts()
    assert len(evals) == 10 and evals == DatasetTask(path).eval_prompts()
    train = list(itertools.islice(task.train_prompts(0), 80))
    assert {p.text for p in train}.isdisjoint({p.text for p in evals})
    assert len({p.text for p in train[:40]}) == 40  # one full epoch before repeating
    assert [p.uid for p in train] == [p.uid for p in itertools.islice(DatasetTask(path).train_prompts(0), 80)]
    p = evals[0]
    assert task.score(p, task.reference_completion(p)) == 1.0
    assert task.score(p, f"I think it is {p.answer}.") == 1.0
    assert task.score(p, f"\\boxed{{{int(p.answer) + 1}}}") == 0.0
    assert task.score(p, "no idea") == 0.0


def test_jsonl_separate_eval_file_removes_overlap(tmp_path):
    train_path = _write(tmp_path / "train.jsonl", _rows(30))
    eval_path = _write(tmp_path / "eval.jsonl", _rows(5))
    task = make_task(TaskConfig(name="jsonl", path=str(train_path), eval_sets={"mine": str(eval_path)}))
    assert {p.eval_set for p in task.eval_prompts()} == {"mine"}
    assert [p.text for p in task.eval_prompts()] == [f"What is {i} times 3?" for i in range(5)]
    seen = {p.text for p in itertools.islice(task.train_prompts(1), 25)}
    assert len(seen) == 25 and not seen & {p.text for p in task.eval_prompts()}


def test_make_task_errors():
    assert isinstance(make_task(TaskConfig()), SortDigitsTask)
    assert isinstance(make_task(TaskConfig(name="addition")), AdditionTask)
    with pytest.raises(ValueError, match="task.path"):
        make_task(TaskConfig(name="jsonl"))
    with pytest.raises(ValueError, match="unknown task"):
        make_task(TaskConfig(name="chess"))


# ---------------------------------------------------------------- warm start


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory):
    from pipeline.models.tiny import ensure_tiny_model

    return ensure_tiny_model("dense", root=tmp_path_factory.mktemp("models"))


def test_warm_start_lowers_loss_and_is_cached(tmp_path, tiny_dense):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.models.warmstart import WarmStartConfig, _batch, ensure_warm_start

    task = AdditionTask()
    base = tiny_dense
    cfg = WarmStartConfig(steps=25, batch_size=16)
    out = ensure_warm_start(base, task, cfg, root=tmp_path / "ws")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_warm_start(base, task, cfg, root=tmp_path / "ws") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert ensure_warm_start(base, task, WarmStartConfig(steps=0), root=tmp_path / "ws") != out

    tok = AutoTokenizer.from_pretrained(str(out))
    input_ids, attention, labels = _batch(tok, task, task.eval_prompts()[:32])
    # only the answer digits and the EOS token carry labels
    assert ((labels != -100).sum(1) == torch.tensor([len(p.answer) + 1 for p in task.eval_prompts()[:32]])).all()
    with torch.no_grad():
        losses = [AutoModelForCausalLM.from_pretrained(str(d))(input_ids=input_ids, attention_mask=attention,
                                                              labels=labels).loss.item() for d in (base, out)]
    assert losses[1] < losses[0] - 1.0, losses


def test_noisy_warm_start_mixes_in_distractors_and_evaluation_is_consistent(tiny_dense):
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.tasks.hf_eval import evaluate
    from pipeline.models.warmstart import _batch

    task = SortDigitsTask()
    base = tiny_dense
    tok = AutoTokenizer.from_pretrained(str(base))
    prompts = list(itertools.islice(task.train_prompts(0), 200))
    _, _, labels = _batch(tok, task, prompts, distractor_fraction=0.5, rng=random.Random(0))
    targets = [tok.decode([t for t in row.tolist() if t >= 0], skip_special_tokens=True) for row in labels]
    distracted = sum(t == task.distractor_completion(p) for t, p in zip(targets, prompts))
    assert all(t in (p.answer, task.distractor_completion(p)) for t, p in zip(targets, prompts))
    assert 70 < distracted < 130  # about half of 200

    model = AutoModelForCausalLM.from_pretrained(str(base))
    m = evaluate(model, tok, task, task.eval_prompts()[:8], k=2, batch_size=8)
    assert m["k"] == 2 and m["greedy_accuracy"] == 0.0  # random weights never sort 6-8 digits
    assert 0.0 <= m["sampled_accuracy"] <= m["pass_at_k"] <= 1.0


def test_warm_start_is_deterministic(tmp_path, tiny_dense):
    import torch
    from safetensors.torch import load_file

    from pipeline.models.warmstart import WarmStartConfig, train_warm_start

    cfg = WarmStartConfig(steps=3, batch_size=8)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        train_warm_start(tiny_dense, SortDigitsTask(), cfg, tmp_path / name)
    a, b = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("a", "b"))
    base = load_file(str(tiny_dense / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], base["lm_head.weight"])
