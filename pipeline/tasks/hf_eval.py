"""Accuracy of a Hugging Face checkpoint on a task with transformers `generate` (no vLLM needed).

Invariants:
- Prompts are rendered by `fmt` (pipeline.tasks.prompting; default: the chat template, one user turn),
  left-padded in batches.
- Greedy accuracy = mean score of one greedy completion per prompt; pass@k = fraction of prompts with at
  least one of k completions sampled at `temperature` (no top-k/top-p truncation) scoring 1.0 (torch seeded
  by `seed`); sampled accuracy = mean score of those k samples.
- Completions stop at the tokenizer's EOS token or after `max_new_tokens`; they are decoded without
  special tokens before scoring.
"""
from __future__ import annotations

from collections.abc import Sequence

from pipeline.tasks.base import Prompt, Task
from pipeline.tasks.prompting import PromptFormat


def _generate(model, tokenizer, task: Task, prompts: Sequence[Prompt], *, do_sample: bool, num_return: int,
              temperature: float, max_new_tokens: int, batch_size: int, fmt: PromptFormat) -> list[list[str]]:
    import torch

    texts = [fmt.render(tokenizer, task, p) for p in prompts]
    out: list[list[str]] = []
    tokenizer.padding_side = "left"
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                        add_special_tokens=fmt.style == "raw")
        with torch.no_grad():
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if do_sample else {}
            gen = model.generate(
                **enc, **sampling, num_return_sequences=num_return, max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )
        decoded = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        out.extend(decoded[i:i + num_return] for i in range(0, len(decoded), num_return))
    return out


def evaluate(model, tokenizer, task: Task, prompts: Sequence[Prompt], *, k: int = 8, temperature: float = 1.0,
             max_new_tokens: int = 16, batch_size: int = 100, seed: int = 0,
             fmt: PromptFormat = PromptFormat()) -> dict[str, float]:
    """{"greedy_accuracy", "pass_at_k", "sampled_accuracy"} of `model` on `prompts`."""
    import torch

    greedy = _generate(model, tokenizer, task, prompts, do_sample=False, num_return=1, temperature=1.0,
                       max_new_tokens=max_new_tokens, batch_size=batch_size, fmt=fmt)
    greedy_scores = [task.score(p, c[0]) for p, c in zip(prompts, greedy)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        sampled = _generate(model, tokenizer, task, prompts, do_sample=True, num_return=k, temperature=temperature,
                            max_new_tokens=max_new_tokens, batch_size=max(1, batch_size // k), fmt=fmt)
    sampled_scores = [[task.score(p, c) for c in cs] for p, cs in zip(prompts, sampled)]
    n = len(prompts)
    return {
        "greedy_accuracy": sum(greedy_scores) / n,
        "pass_at_k": sum(max(s) for s in sampled_scores) / n,
        "sampled_accuracy": sum(sum(s) / k for s in sampled_scores) / n,
        "k": k,
    }
