"""Build the orchestrator of a run from its config: prompt sources, scorer and record schema.

Tasks are tokenized once here (`docs/architecture.md`, "Contracts"): each prompt becomes chat-templated token ids with the
model's tokenizer; the verifier scores decoded completion text with the task's exact checker.
``task.name=synthetic`` is the data plane's own load (random token prompts, a token-level
verifier, no tokenizer) used by tests and benchmarks of the transport, buffer and log.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from pipeline.config import TokenflowConfig, record_schema
from pipeline.orchestrator.prompts import PromptItem, PromptSource, SyntheticPromptSource, TextPromptSource
from pipeline.orchestrator.scoring import Scorer, VerifierScorer, last_token_verifier
from pipeline.orchestrator.service import Orchestrator
from pipeline.roles.common import model_dir

#: Prompts drawn from a task's training stream; the prompt source walks seeded permutations of them.
TRAIN_PROMPTS = 20_000


def task_sources(cfg: TokenflowConfig, run_dir: Path) -> tuple[PromptSource, PromptSource, Scorer]:
    """(training prompts, held-out prompts, scorer) of the run's task."""
    seed = cfg.orchestrator.seed
    if cfg.task.name == "synthetic":
        return (SyntheticPromptSource(seed=seed), SyntheticPromptSource(n_prompts=cfg.task.eval_size,
                                                                         seed=seed + 1),
                VerifierScorer(last_token_verifier))
    from transformers import AutoTokenizer

    from pipeline.tasks import make_task

    task = make_task(cfg.task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir(run_dir))

    def encode(prompt) -> list[int]:
        return tokenizer.apply_chat_template(task.messages(prompt), add_generation_prompt=True,
                                             tokenize=True, return_dict=False)

    def verify(item: PromptItem, completion_ids: np.ndarray) -> float:
        text = tokenizer.decode(completion_ids, skip_special_tokens=True)
        return float(task.score(item.answer, text))

    train = list(itertools.islice(task.train_prompts(seed), TRAIN_PROMPTS))
    evals = task.eval_prompts()
    return (TextPromptSource([(p, p) for p in train], encode, seed),
            TextPromptSource([(p, p) for p in evals], encode, seed), VerifierScorer(verify))


def build_orchestrator(run_dir: Path, cfg: TokenflowConfig) -> Orchestrator:
    t = cfg.orchestrator.transport
    if cfg.cluster.launcher == "slurm" and t.interface is None and t.host == "127.0.0.1":
        t.host = "0.0.0.0"  # generators run on other nodes: listen on every interface
    train, evals, scorer = task_sources(cfg, run_dir)
    return Orchestrator(run_dir, cfg.orchestrator, train, scorer, record_schema(cfg),
                        run_id=cfg.run.name, eval_prompts=evals,
                        replay_source=Path(cfg.replay.source) if cfg.replay.source else None)
