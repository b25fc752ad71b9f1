"""A byte-level BPE tokenizer trained locally (no hub) on the built-in task's text.

Invariants:
- Byte-level: every string encodes and decodes back exactly (digits are always single tokens, so the
  arithmetic task sees one token per digit).
- Special tokens have fixed ids: 0 `<|im_start|>`, 1 `<|im_end|>` (the EOS token, ends every assistant
  turn), 2 `<|pad|>`. No BOS token is prepended.
- Deterministic: the same corpus and vocabulary size give a byte-identical tokenizer.json;
  `corpus_digest()` fingerprints the inputs so caches can key on them.
- The chat template is Qwen-style: "<|im_start|>user\\n37+48=<|im_end|>\\n<|im_start|>assistant\\n"
  for one user turn with `add_generation_prompt=True`; the assistant then writes "85<|im_end|>".
- `load_tokenizer(dir)` returns what ``AutoTokenizer.from_pretrained(dir)`` returns; a checkpoint whose
  tokenizer is a plain `tokenizers` one (this one, most current checkpoints) is loaded by that class
  directly, without AutoTokenizer's import of torch (1.0 instead of 4.6 CPU s).
"""
from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (IM_START, IM_END, PAD)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# General math wording so that users' dataset prompts (pipeline.tasks.dataset) are not all single bytes.
_MATH_WORDS = (
    "system user assistant What is the sum of and Compute the value Find the number Solve for x "
    "the answer is Calculate the product difference quotient remainder total how many more less than "
    "If a has then each Let be a positive integer Put your final answer in \\boxed{} Therefore so "
    "The result equals plus minus times divided by fraction decimal percent of a number square root"
)

# Number of prompts (with their answers) of each built-in task in the training corpus.
_CORPUS_PROMPTS = 2000


def builtin_corpus() -> list[str]:
    """The fixed training text: built-in task prompts and answers plus general math wording."""
    from pipeline.tasks.addition import AdditionTask
    from pipeline.tasks.sorting import SortDigitsTask

    lines = []
    for task in (SortDigitsTask(min_digits=3, max_digits=8), AdditionTask()):
        stream = task.train_prompts(seed=0)
        lines += [f"user\n{p.text}\nassistant\n{p.answer}" for p in itertools.islice(stream, _CORPUS_PROMPTS)]
    return lines + [_MATH_WORDS] * 8


def corpus_digest(corpus: Sequence[str], vocab_size: int) -> str:
    """Stable fingerprint of the tokenizer's inputs (16 hex digits)."""
    h = hashlib.sha256(f"bpe-v1|{vocab_size}|{CHAT_TEMPLATE}".encode())
    for line in corpus:
        h.update(line.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def train_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 512):
    """Train the byte-level BPE and wrap it as a transformers fast tokenizer with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + specials), got {vocab_size}")
    lines = list(builtin_corpus() if corpus is None else corpus)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(lines, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    for i, special in enumerate(SPECIAL_TOKENS):
        got = tok.convert_tokens_to_ids(special)
        if got != i:
            raise RuntimeError(f"special token {special} got id {got}, expected {i}")
    return tok


def save_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """Train on the built-in corpus, save into `out_dir`; returns the tokenizer's length."""
    tok = train_tokenizer(vocab_size=vocab_size)
    tok.save_pretrained(str(out_dir))
    return len(tok)


#: tokenizer_config.json ``tokenizer_class`` values AutoTokenizer loads as transformers' `tokenizers` backend
TOKENIZERS_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: Path | str):
    """The tokenizer of the checkpoint in `model_dir` (module invariants)."""
    path = Path(model_dir)
    config = path / "tokenizer_config.json"
    named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if named in TOKENIZERS_BACKEND_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
