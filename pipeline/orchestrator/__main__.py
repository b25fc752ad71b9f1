"""``python -m pipeline.orchestrator RUN_DIR``: serve a run described by RUN_DIR/orchestrator.json.

The file holds ``{"orchestrator": {...OrchestratorConfig...}, "prompts": {...}, "scorer": NAME,
"schema": {...RecordSchema...}, "run_id": ..., "eval_prompts": {...}}``. The training launcher writes it; tests and
benchmarks write it directly. Prompt sources: ``{"kind": "synthetic", ...SyntheticPromptSource
kwargs}``. Scorers: ``last_token`` (the synthetic task's verifier).
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from pipeline.orchestrator.config import OrchestratorConfig
from pipeline.orchestrator.prompts import SyntheticPromptSource
from pipeline.orchestrator.scoring import VerifierScorer, last_token_verifier
from pipeline.orchestrator.service import Orchestrator
from pipeline.record import RecordSchema
from pipeline.transport import TransportConfig


def build(run_dir: Path) -> Orchestrator:
    spec = json.loads((run_dir / "orchestrator.json").read_text())
    ocfg = dict(spec.get("orchestrator", {}))
    ocfg["transport"] = TransportConfig(**ocfg.get("transport", {}))
    cfg = OrchestratorConfig(**ocfg)
    prompts_spec = dict(spec.get("prompts", {"kind": "synthetic"}))
    kind = prompts_spec.pop("kind")
    if kind != "synthetic":
        raise ValueError(f"unknown prompt source kind {kind!r} in {run_dir / 'orchestrator.json'}")
    prompts = SyntheticPromptSource(seed=cfg.seed, **prompts_spec)
    eval_spec = spec.get("eval_prompts")
    eval_prompts = SyntheticPromptSource(seed=cfg.seed + 1, **eval_spec) if eval_spec else None
    scorers = {"last_token": VerifierScorer(last_token_verifier)}
    scorer = scorers[spec.get("scorer", "last_token")]
    schema = RecordSchema.from_dict(spec.get("schema", {}))
    return Orchestrator(run_dir, cfg, prompts, scorer, schema, spec.get("run_id", run_dir.name),
                        eval_prompts=eval_prompts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pipeline.orchestrator RUN_DIR", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s")
    build(Path(argv[0])).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
