"""`tokenflow doctor`: what a run will use, and the contradictions refused before anything starts.

A check is a function ``check(run) -> None`` registered in order with ``@check("name")``
(`pipeline.doctor.registry`)
(`pipeline.doctor.checks`: placement, engine, trainer, checkpoint; `pipeline.doctor.network_checks`:
weights, network; `pipeline.doctor.memory`: the trainer's planned peak; `pipeline.doctor.checkpoint_grace`:
whether a checkpoint fits the time a stop leaves). It reports through the `Run` it is given: ``run.uses(text)`` for
what the run will use (printed), ``run.refuse(text)`` for a contradiction (the run is refused).
`run_checks` runs every check, each one's failure (an exception) becoming a refusal that names
it, so the doctor itself never ends in a traceback. `tokenflow train` runs the same checks and
starts nothing when any refuses (exit status 2).

Invariant: the checks are cheap (no torch, vLLM or megatron-core import: facts come from the
config, package metadata, the model's config.json, nvidia-smi and a write probe of at most 2 s in
the checkpoint directory), so every `tokenflow train` can afford them.

Example (this CPU machine, ``cluster.trainer.gpus_per_node=1``)::

    [placement] this node: 0 GPUs
    [placement] trainer.0: GPUs none (needs 1) ...
    refused: [placement] trainer asks for 1 GPU(s) per node; this node has 0
"""
from __future__ import annotations

import traceback

from pipeline.doctor.registry import CHECKS, Run


def run_checks(cfg, plan) -> Run:
    """Every registered check on ``cfg`` and ``plan``; the findings are in the returned `Run`."""
    from pipeline.doctor import checks, memory, network_checks, checkpoint_grace  # noqa: F401  (registers the checks, in this order)

    run = Run(cfg, plan)
    for name, fn in CHECKS:
        run.current = name
        try:
            fn(run)
        except Exception as exc:  # a check that cannot run is a refusal naming it
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            run.refuse(f"the check could not run: {last}")
    return run


def report(run: Run) -> str:
    """The findings as text: what the run uses, then every refusal."""
    lines = [f"[{f.check}] {f.text}" for f in run.findings if not f.refused]
    lines += [f"refused: [{f.check}] {f.text}" for f in run.refusals]
    return "\n".join(lines)
