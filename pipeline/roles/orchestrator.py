"""Build the orchestrator of a run from its config: prompt sources, scorer and record schema.

Tasks are served by pipeline.tasks.sources: each prompt is tokenized once with the model's tokenizer
(chat template or raw, pipeline.tasks.prompting); (`docs/architecture.md`, "Contracts"); the verifier scores decoded completion text with
the task's checker.
``task.name=synthetic`` is the data plane's own load (random token prompts, a token-level
verifier, no tokenizer) used by tests and benchmarks of the transport, buffer and log.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.config import TokenflowConfig, stored_record_schema
from pipeline.metrics import MetricsWriter
from pipeline.orchestrator.batching import StepCost
from pipeline.orchestrator.bounds import RunBounds
from pipeline.orchestrator.prompts import PromptSource, SyntheticPromptSource
from pipeline.orchestrator.scoring import Scorer, VerifierScorer, last_token_verifier
from pipeline.orchestrator.service import Orchestrator
from pipeline.plan.shape import ModelShape
from pipeline.run_dir import model_dir

def task_sources(cfg: TokenflowConfig, run_dir: Path) -> tuple[PromptSource, PromptSource, Scorer]:
    """(training prompts, held-out prompts, scorer) of the run's task."""
    seed = cfg.orchestrator.seed
    if cfg.task.name == "synthetic":
        return (SyntheticPromptSource(seed=seed), SyntheticPromptSource(n_prompts=cfg.task.eval_size,
                                                                         seed=seed + 1),
                VerifierScorer(last_token_verifier))
    from pipeline.models.tokenizer import load_tokenizer
    from pipeline.tasks.sources import task_prompt_sources

    tokenizer = load_tokenizer(model_dir(run_dir))
    train, evals, verify, counts = task_prompt_sources(cfg.task, tokenizer, seed)
    if counts:  # the dataset rows left out: bad rows (task.on_bad_row=skip), prompts over the budget
        metrics = MetricsWriter(run_dir, "orchestrator")
        metrics.log("dataset", train_rows=len(train), eval_prompts=len(evals), **counts)
        metrics.close()
    return train, evals, VerifierScorer(verify)


def build_orchestrator(run_dir: Path, cfg: TokenflowConfig) -> Orchestrator:
    t = cfg.orchestrator.transport
    net = cfg.cluster.network
    if t.interface is None and t.host == "127.0.0.1" and (net.address or net.interface):
        from pipeline.launch.network import listen_address
        t.host = listen_address(net, t.host)  # the run's chosen network (pipeline.launch.network)
    elif cfg.cluster.launcher == "slurm" and t.interface is None and t.host == "127.0.0.1":
        t.host = "0.0.0.0"  # generators run on other nodes: listen on every interface
    train, evals, scorer = task_sources(cfg, run_dir)
    schema = stored_record_schema(cfg)
    scoring = None
    if cfg.scorers.remote and not cfg.replay.source:  # scorer roles (pipeline.scorers)
        from pipeline.scorers.pool import RemoteScoring
        scoring = RemoteScoring(run_dir, cfg.scorers, schema,
                                scorer if cfg.scorers.reward == "verifier" else None, t,
                                refresh_every=cfg.run.checkpoint_every)
    synthetic = isinstance(train, SyntheticPromptSource)
    bounds = RunBounds(train.vocab) if synthetic else RunBounds.of_model(model_dir(run_dir))
    o = cfg.orchestrator
    step_cost = StepCost() if synthetic else StepCost(o.step_cost_per_token, o.step_cost_per_token_pair, o.step_cost_per_sample) \
        if o.step_cost_per_token is not None else StepCost.of_shape(ModelShape.from_file(model_dir(run_dir)))
    return Orchestrator(run_dir, cfg.orchestrator, train, scorer, schema, bounds,
                        run_id=cfg.run.name, eval_prompts=evals,
                        replay_source=Path(cfg.replay.source) if cfg.replay.source else None,
                        scoring=scoring, eval_samples=cfg.eval.samples, step_cost=step_cost)
