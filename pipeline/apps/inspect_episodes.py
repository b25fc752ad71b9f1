"""The episode part of `tokenflow inspect`: turns, tool calls, masked tokens and per-turn versions of
a log whose record schema has ``model_mask`` (multi-turn episodes, `pipeline.generator.episodes`).

A *turn* is a maximal run of completion tokens with the same ``model_mask`` value: a model turn (1)
or an environment turn (0, an observation such as a tool's answer). Worked example: mask
[1,1,1,0,0,1,1] with versions [3,3,3,3,3,4,4] is three turns: model (3 tokens, versions 3..3),
environment (2 tokens, masked: no gradient), model (2 tokens, versions 4..4); the episode has one
tool call (one environment turn) and spans 2 policy versions.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.protocol.record import FINISH_REASONS
from pipeline.protocol.sample_batch import SampleBatch


def turns(model_mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """(start, end, is_model) of each turn of one completion (see the module docstring)."""
    mask = np.asarray(model_mask).astype(bool)
    if not len(mask):
        return []
    cuts = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    bounds = [0, *cuts.tolist(), len(mask)]
    return [(a, b, bool(mask[a])) for a, b in zip(bounds[:-1], bounds[1:])]


def describe(batch: SampleBatch, i: int, tokenizer=None) -> dict:
    """One episode of a batch: its turns with token counts, versions and (with a tokenizer) text."""
    ids, mask, versions = (batch.tokens(k, i) for k in ("completion_ids", "model_mask", "versions"))
    out = []
    for a, b, is_model in turns(mask):
        turn = {"role": "model" if is_model else "env", "tokens": b - a,
                "versions": [int(versions[a]), int(versions[b - 1])]}
        if tokenizer is not None:
            turn["text"] = tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False)
        out.append(turn)
    c = batch.columns
    return {"group_id": int(c["group_id"][i]), "sample_index": int(c["sample_index"][i]),
            "reward": float(c["reward"][i]), "finish_reason": FINISH_REASONS[int(c["finish_reason"][i])],
            "turns": out}


def summarize_episodes(log, examples: int = 3, tokenizer=None) -> dict:
    """Totals over every episode of an open `RolloutLog` plus the last `examples` episodes in full."""
    model_turns: list[int] = []
    env_tokens = model_tokens = spanning = 0
    last: list[dict] = []
    for batch in log.iter_batches():
        for i in range(len(batch)):
            mask = batch.tokens("model_mask", i)
            t = turns(mask)
            model_turns.append(sum(1 for _, _, m in t if m))
            n_model = int(mask.sum())
            model_tokens += n_model
            env_tokens += len(mask) - n_model
            v = batch.tokens("versions", i)
            spanning += int(v[0] != v[-1])
        take = range(max(0, len(batch) - examples), len(batch))
        last = (last + [describe(batch, i, tokenizer) for i in take])[-examples:] if examples else []
    mt = np.asarray(model_turns, dtype=np.int64)
    keys, counts = np.unique(mt, return_counts=True)
    return {"episodes": int(len(mt)),
            "model_turns": {str(int(k)): int(c) for k, c in zip(keys, counts)},
            "tool_calls": int((mt - 1).clip(min=0).sum()),
            "model_tokens": model_tokens, "env_tokens_masked": env_tokens,
            "spanning_versions": spanning, "examples": last}


def run_tokenizer(path: Path):
    """The tokenizer of the run a log belongs to (its prepared model), or None when not found."""
    from pipeline.run_files import MODEL_FILE

    path = Path(path)
    for run_dir in (path, path.parent, path.parent.parent):
        if (run_dir / MODEL_FILE).exists():
            from transformers import AutoTokenizer

            from pipeline.run_dir import model_dir
            try:
                return AutoTokenizer.from_pretrained(str(model_dir(run_dir)))
            except OSError:
                return None
    return None


def format_episodes(e: dict) -> list[str]:
    """The episode summary as text lines."""
    out = [f"episodes      {e['episodes']:,}  (model turns per episode: "
           + ", ".join(f"{k}: {v:,}" for k, v in e["model_turns"].items()) + ")",
           f"tool calls    {e['tool_calls']:,}; tokens: model {e['model_tokens']:,}, environment "
           f"{e['env_tokens_masked']:,} (masked: no gradient); {e['spanning_versions']:,} episodes span "
           f"more than one policy version"]
    for ex in e["examples"]:
        reward = "-" if ex["reward"] is None or ex["reward"] != ex["reward"] else f"{ex['reward']:.2f}"
        out.append(f"episode       group {ex['group_id']} sample {ex['sample_index']}: reward {reward}, "
                   f"{ex['finish_reason']}")
        for t in ex["turns"]:
            v = t["versions"]
            text = f"  {t['text']!r}" if "text" in t else ""
            out.append(f"  {t['role']:<5} {t['tokens']:>4} tokens  v{v[0]}" + (f"-{v[1]}" if v[1] != v[0] else "")
                       + text)
    return out
