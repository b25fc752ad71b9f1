"""``tokenflow doctor [overrides]``: print what ``tokenflow train`` with the same overrides would
use (GPUs, placement of every rank and engine, engine runner and compilation, megatron-core and
its patches, the checkpoint against the engine) and refuse its contradictions (exit status 2),
starting nothing (`pipeline.doctor`)."""
from __future__ import annotations

import sys
from pathlib import Path


def diagnose(cfg) -> int:
    """Print the checks' findings for a composed config; 0, or 2 when the run would be refused."""
    from pipeline.apps.train import job_plan
    from pipeline.config import validate
    from pipeline.doctor import report, run_checks

    try:
        validate(cfg)
        plan = job_plan(cfg, Path(cfg.run.dir).resolve())
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenflow doctor: the config is refused: {exc}", file=sys.stderr)
        return 2
    run = run_checks(cfg, plan)
    print(report(run))
    return 2 if run.refusals else 0


def main(argv: list[str] | None = None) -> int:
    import hydra
    from omegaconf import OmegaConf

    from pipeline.apps.train import CONFIGS
    from pipeline.config import register

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    register()
    status: list[int] = []

    @hydra.main(config_path=str(CONFIGS), config_name="train", version_base=None)
    def app(dcfg) -> None:
        status.append(diagnose(OmegaConf.to_object(dcfg)))

    sys.argv = ["tokenflow doctor", *argv, "hydra.output_subdir=null", "hydra/job_logging=none",
                "hydra/hydra_logging=none"]
    app()
    return status[0] if status else 2
