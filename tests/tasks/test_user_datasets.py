"""Users' datasets in every format `task=dataset` reads, with nothing but `task.path`: verl's GSM8K
Parquet layout (written here with pyarrow), a `datasets.save_to_disk` directory, an Arrow file and
JSONL; each served by the orchestrator's prompt sources, its ground truth scoring 1 through the
orchestrator's verifier; bad rows refused before anything starts (or skipped and counted); named
held-out sets; prompts over the budget left out. No engine here (the training runs:
tests/apps/test_user_runs.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.models.tokenizer import train_tokenizer
from pipeline.tasks import TaskConfig, make_task
from pipeline.tasks.sources import task_prompt_sources

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def gsm8k_rows(n: int) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    rows = []
    for i in range(n):
        a, b = 3 + i, 7 + 2 * i
        question = f"Tom has {a} apples and buys {b} more. How many apples does he have now?"
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"split": "train", "index": i, "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
                                    "question": question}})
    return rows


def write_gsm8k_parquet(path, n: int = 200, bad: dict[int, dict] | None = None):
    rows = gsm8k_rows(n)
    for i, change in (bad or {}).items():
        rows[i] = {**rows[i], **change}
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The same 200 problems as verl Parquet, a datasets directory, an Arrow file and JSONL."""
    import datasets

    root = tmp_path_factory.mktemp("formats")
    parquet = write_gsm8k_parquet(root / "gsm8k.parquet")
    flat = [{"prompt": r["prompt"][0]["content"], "answer": r["reward_model"]["ground_truth"]} for r in gsm8k_rows(200)]
    saved = root / "saved"
    datasets.Dataset.from_parquet(str(parquet)).save_to_disk(str(saved))
    arrow = root / "flat.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, pa.Table.from_pylist(flat).schema) as w:
        w.write_table(pa.Table.from_pylist(flat))
    jsonl = root / "flat.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in flat))
    return {"parquet": parquet, "saved": saved, "arrow": arrow, "jsonl": jsonl}


@pytest.mark.parametrize("fmt", ["parquet", "saved", "arrow", "jsonl"])
def test_every_format_is_served_and_its_ground_truth_scores_one(formats, tokenizer, fmt):
    reference = {r["prompt"][0]["content"]: r["reward_model"]["ground_truth"] for r in gsm8k_rows(200)}
    train, evals, verify, counts = task_prompt_sources(TaskConfig(name="dataset", path=str(formats[fmt])),
                                                       tokenizer, seed=3)
    assert len(train) + len(evals) == 200 and len(evals) == 40 and counts["bad_rows"] == 0
    for item in [train.for_group(g) for g in (0, 7, 159, 160, 333)] + [evals.for_group(g) for g in (0, 39)]:
        prompt = item.answer
        assert reference[prompt.text] == prompt.answer
        rendered = tokenizer.decode(item.token_ids)
        assert rendered.startswith("<|im_start|>user\n") and prompt.text in rendered  # the chat template
        right = tokenizer.encode(f"The answer is \\boxed{{{prompt.answer}}}", add_special_tokens=False)
        wrong = tokenizer.encode(f"The answer is \\boxed{{{int(prompt.answer) + 1}}}", add_special_tokens=False)
        assert verify(item, np.array(right)) == 1.0 and verify(item, np.array(wrong)) == 0.0
    if fmt in ("parquet", "saved"):  # verl's columns came through
        assert prompt.data_source == "openai/gsm8k" and json.loads(prompt.extra_info)["split"] == "train"
        assert {p.eval_set for p in [evals.for_group(g).answer for g in range(40)]} == {"heldout"}


def test_reward_by_data_source_and_a_verl_style_function_by_path(formats, tmp_path):
    fn = tmp_path / "reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return float(solution_str.strip().endswith('#### ' + ground_truth))\n")
    task = make_task(TaskConfig(name="dataset", path=str(formats["parquet"]),
                                reward_by_source={"openai/gsm8k": f"{fn}:compute_score"}))
    p = task.eval_prompts()[0]
    assert task.score(p, f"so\n#### {p.answer}") == 1.0 and task.score(p, f"\\boxed{{{p.answer}}}") == 0.0
    plain = make_task(TaskConfig(name="dataset", path=str(formats["parquet"]), verifier="simple"))
    assert plain.score(p, f"\\boxed{{{p.answer}}}") == 1.0


def test_named_held_out_sets_leave_training_and_are_labelled(formats, tmp_path):
    rows = gsm8k_rows(200)
    small = tmp_path / "small.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:5]), small)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(3)))
    task = make_task(TaskConfig(name="dataset", path=str(formats["parquet"]),
                                eval_sets={"gsm8k-5": str(small), "doubles": str(other)}))
    labels = [p.eval_set for p in task.eval_prompts()]
    assert labels == ["gsm8k-5"] * 5 + ["doubles"] * 3 and task.train_size == 195
    held = {p.text for p in task.eval_prompts()}
    assert not held & {task.prompt_by_id(0, i).text for i in range(task.train_size)}


def test_bad_rows_are_named_or_skipped_and_long_prompts_counted(tmp_path, tokenizer):
    bad = write_gsm8k_parquet(tmp_path / "bad.parquet", bad={137: {"reward_model": {"style": "rule", "ground_truth": " "}},
                                                            150: {"prompt": [{"role": "user"}]}})
    with pytest.raises(ValueError, match=r"bad.parquet: row 137: 'reward_model.ground_truth' is empty"):
        make_task(TaskConfig(name="dataset", path=str(bad)))
    lengths = [len(tokenizer(tokenizer.apply_chat_template([r["prompt"][0]], add_generation_prompt=True,
                                                           tokenize=False), add_special_tokens=False)["input_ids"])
               for i, r in enumerate(gsm8k_rows(200)) if i not in (137, 150)]
    limit = max(lengths) - 1  # the longest prompts are over the budget
    cfg = TaskConfig(name="dataset", path=str(bad), on_bad_row="skip", max_prompt_tokens=limit)
    train, evals, _, counts = task_prompt_sources(cfg, tokenizer, seed=0)
    assert counts["bad_rows"] == 2
    assert counts["too_long_train"] + counts["too_long_eval"] == sum(n > limit for n in lengths) > 0
    assert len(train) + len(evals) == sum(n <= limit for n in lengths)
    assert max(len(train.for_group(g).token_ids) for g in range(len(train))) <= limit
    with pytest.raises(ValueError, match="columns.answer"):
        make_task(TaskConfig(name="dataset", path=str(bad), columns={"answer": "solution"}))


def test_dataset_budgets_follow_the_models_positions(formats):
    """Unset budgets that the model cannot hold (1024 + 1024 in the tiny models' 1024 positions); no
    warm-start on a user's dataset, the tiny models' neither."""
    from pipeline.config import TokenflowConfig, validate

    cfg = TokenflowConfig(task=TaskConfig(name="dataset", path=str(formats["parquet"])))
    validate(cfg)
    assert (cfg.task.max_tokens, cfg.task.max_prompt_tokens) == (256, 768)
    assert (cfg.generator.max_tokens, cfg.generator.max_model_len) == (256, 1024)
    assert cfg.model.warmstart_steps == 0  # the data as given: no minutes-long warm-start on it
    kept = TokenflowConfig(task=TaskConfig(name="dataset", path=str(formats["parquet"]), max_tokens=24))
    validate(kept)
    assert (kept.task.max_tokens, kept.task.max_prompt_tokens, kept.generator.max_model_len) == (24, 1024, 1024)


def test_a_bad_row_stops_the_train_command_before_anything_starts(tmp_path):
    """The launch validates the data: the command fails naming the row, no role is started."""
    bad = write_gsm8k_parquet(tmp_path / "bad.parquet", bad={42: {"prompt": []}})
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", "task=dataset", f"task.path={bad}",
                          f"hydra.run.dir={tmp_path / 'run'}", "run.progress=false"],
                         capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    assert "bad.parquet: row 42: a chat-list prompt needs {'role', 'content'} strings" in out.stderr + out.stdout
    assert not (tmp_path / "run" / "launch").exists(), "a role was launched"
    print(f"bad row refused in {elapsed:.1f} s")
