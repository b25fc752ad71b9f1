"""``tokenflow replay LOG [overrides]``: train from a recorded rollout log instead of live generators.

The orchestrator's source becomes the log (groups fed in the order they were stored, with their
recorded rewards); no generator starts; the trainer's PPO-clip/TIS loss takes its importance
weights against the recorded behaviour logprobs. Unless overridden, the model is the one the
recorded run started from (its tokenizer produced the token ids) and the run is named
``<source run>-replay``. Staleness rejection is off: every recorded group is off-policy by design.

Example: ``tokenflow replay runs/demo run.steps=20 trainer.lr=5e-5``.
"""
from __future__ import annotations

import sys
from pathlib import Path


def source_defaults(log_path: Path) -> list[str]:
    """Overrides taken from the recorded run's directory, when the log sits in one."""
    from omegaconf import OmegaConf

    from pipeline.run_dir import model_dir
    from pipeline.run_files import CONFIG_FILE, MODEL_FILE

    run_dir = log_path if (log_path / CONFIG_FILE).exists() else log_path.parent
    if log_path.suffix == ".h5":
        run_dir = log_path.parent.parent
    out = [f"run.name={run_dir.name}-replay"]
    cfg_file = run_dir / CONFIG_FILE
    if (run_dir / MODEL_FILE).exists():
        out += [f"model.name={model_dir(run_dir)}", "model.warmstart_steps=0"]
    if cfg_file.exists():
        old = OmegaConf.load(cfg_file)
        out += [f"task.name={old.task.name}", f"orchestrator.group_size={old.orchestrator.group_size}",
                f"generator.temperature={old.generator.temperature}",
                f"trainer.temperature={old.generator.temperature}"]
        if old.task.get("path"):
            out.append(f"task.path={old.task.path}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print("usage: tokenflow replay LOG [OVERRIDES...]\n\n" + __doc__.strip(), file=sys.stderr)
        return 2
    source = Path(argv[0]).resolve()
    if not source.exists():
        print(f"tokenflow replay: {source} does not exist", file=sys.stderr)
        return 2
    from pipeline.rollout_log.format import LogError
    from pipeline.rollout_log.reader import RolloutLog
    try:
        with RolloutLog.open(source) as log:
            n_groups = int(log.resume_state().counts.get("stored", 0))
    except LogError as exc:
        print(f"tokenflow replay: {exc}", file=sys.stderr)
        return 2
    print(f"tokenflow replay: {n_groups} recorded groups in {source}", flush=True)
    from pipeline.apps.train import main as train_main
    fixed = [f"replay.source={source}", "cluster.generators=0", "run.eval_every=0",
             "orchestrator.max_staleness=1000000000"]
    return train_main(source_defaults(source) + fixed + argv[1:])
