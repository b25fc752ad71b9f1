"""How a task prompt becomes the token ids a generator sees: chat template or raw text.

Invariants:
- One rendering for every consumer: the orchestrator (the ids it sends and records), the supervised
  warm-start and the transformers evaluation all call `PromptFormat.encode`, so what a run trains on
  is what it recorded (the rollout record keeps these exact prompt ids).
- "chat": messages = [system turn if `system_prompt`] + the task's user turn, rendered by the
  tokenizer's chat template with ``add_generation_prompt=True`` and `template_kwargs` (e.g. Qwen3's
  ``enable_thinking=False``), then tokenized without adding special tokens again.
- "raw": the prompt text tokenized as is, with the tokenizer's own special tokens (e.g. Llama's BOS);
  `system_prompt` and `template_kwargs` are refused there, as is a tokenizer without a chat template
  under "chat".
- A prompt longer than `max_prompt_tokens` raises ValueError naming the prompt and the field.

Worked example (the tiny tokenizer, system prompt "Be brief."): the prompt "37+48=" renders as
"<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\n37+48=<|im_end|>\\n<|im_start|>assistant\\n".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.tasks.base import Prompt, Task

FORMATS = ("chat", "raw")


@dataclass(frozen=True)
class PromptFormat:
    """The presentation settings of a run's prompts (from TaskConfig)."""

    style: str = "chat"
    system_prompt: str | None = None
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.style not in FORMATS:
            raise ValueError(f"task.prompt_format must be one of {FORMATS}, got {self.style!r}")
        if self.style == "raw" and (self.system_prompt or self.template_kwargs):
            raise ValueError("task.system_prompt and task.chat_template_kwargs need task.prompt_format=chat")

    @classmethod
    def of(cls, task_cfg, task: Task | None = None) -> "PromptFormat":
        """The format a TaskConfig asks for; the prompt limit is the task's when given."""
        kwargs = dict(task_cfg.chat_template_kwargs or {})
        limit = task.max_prompt_tokens if task is not None else task_cfg.max_prompt_tokens
        return cls(style=task_cfg.prompt_format, system_prompt=task_cfg.system_prompt,
                   template_kwargs=tuple(sorted(kwargs.items())), max_prompt_tokens=limit)

    def messages(self, task: Task, prompt: Prompt) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + task.messages(prompt)

    def render(self, tokenizer, task: Task, prompt: Prompt) -> str:
        """The prompt as text, exactly as it is tokenized."""
        if self.style == "raw":
            return prompt.text
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} has no chat template; "
                             "set task.prompt_format=raw")
        return tokenizer.apply_chat_template(self.messages(task, prompt), add_generation_prompt=True,
                                             tokenize=False, **dict(self.template_kwargs))

    def encode(self, tokenizer, task: Task, prompt: Prompt) -> list[int]:
        """The prompt's token ids (see the module invariants)."""
        ids = list(tokenizer(self.render(tokenizer, task, prompt), add_special_tokens=self.style == "raw")["input_ids"])
        if not ids:
            raise ValueError(f"prompt {prompt.uid} tokenizes to nothing")
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise ValueError(f"prompt {prompt.uid} has {len(ids)} tokens > task.max_prompt_tokens="
                             f"{self.max_prompt_tokens}; raise it (generator.max_model_len follows) or "
                             f"shorten the prompt")
        return ids
