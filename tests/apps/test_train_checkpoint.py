"""`tokenflow train` on a locally built Hugging Face checkpoint (qwen2, tied embeddings) with a JSONL task
of a few hundred lines: no warm-start, the task's own max_tokens, a system prompt; the first step's
prompts and completion lengths must be what the config says.

The expected prompt ids are computed here with the tokenizer's chat template directly (not through
pipeline.tasks.prompting), and the expected rows from the file itself: with ``task.shuffle=false`` and
a separate eval file, group g takes the file's row g.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.rollout_log.reader import RolloutLog
from pipeline.models.family_checkpoints import build_family_checkpoint

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
SYSTEM = "Answer with one number."
GROUPS, GROUP_SIZE = 4, 4


def test_train_on_a_checkpoint_and_jsonl_data_uses_the_task_settings(tmp_path):
    from transformers import AutoTokenizer

    ckpt = build_family_checkpoint("qwen2-tied", tmp_path / "qwen2")
    rows = [{"prompt": f"What is {i} plus {i % 7}?", "answer": i + i % 7} for i in range(300)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"prompt": f"What is {i} times 2?", "answer": 2 * i} for i in range(8)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "task=jsonl", f"task.path={tmp_path / 'data.jsonl'}",
           f"model.name={ckpt}", f"hydra.run.dir={run}", "run.name=ckpt", f"task.max_tokens={MAX_TOKENS}",
           f"+task.eval_sets.held_out={tmp_path / 'eval.jsonl'}", "task.shuffle=false", f"task.system_prompt={SYSTEM}",
           "run.steps=2", "run.eval_every=0", "run.checkpoint_every=2", "run.mismatch_every=0",
           f"orchestrator.groups_per_step={GROUPS}", f"orchestrator.group_size={GROUP_SIZE}",
           "generator.enforce_eager=true", "run.timeout_s=300", "run.progress=false", "logger=[]"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, f"train failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["warmstart_steps"] == 0
    assert cfg["generator"]["max_tokens"] == MAX_TOKENS and cfg["generator"]["max_num_seqs"] == 256
    assert cfg["generator"]["max_model_len"] == 1024 + MAX_TOKENS  # task.max_prompt_tokens + max_tokens
    assert Path(json.loads((run / "model.json").read_text())["path"]) == ckpt.resolve()  # no warm-start copy

    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    with RolloutLog.open(run) as log:
        first = log.read(log.step_rows()[0])
    samples = list(first)
    assert len(samples) == GROUPS * GROUP_SIZE
    lengths = [len(s.completion_ids) for s in samples]
    print(f"\nstep 0: groups {sorted({s.group_id for s in samples})}, completion lengths {lengths}")
    assert max(lengths) == MAX_TOKENS and min(lengths) >= 1
    for s in samples:
        row = rows[s.group_id]
        assert s.prompt_id == s.group_id
        text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": row["prompt"]}],
                                             add_generation_prompt=True, tokenize=False)
        assert s.prompt_ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
