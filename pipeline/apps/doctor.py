"""``tokenflow doctor [overrides]``: print what ``tokenflow train`` with the same overrides would
use (GPUs, placement of every rank and engine, engine runner and compilation, megatron-core and
its patches, the checkpoint against the engine) and refuse its contradictions (exit status 2),
starting nothing (`pipeline.doctor`).

``tokenflow doctor --probe [overrides]`` also starts the run's job (local processes or one Slurm
job, the same components, nodes and partitions) with every role replaced by the probe
(`pipeline.launch.probe`, option ``reach``): each task listens on its node's address chosen by
``cluster.network`` and connects to every other task's; any pair that cannot connect refuses the
run (exit status 2). It takes one allocation of the run's size for a few seconds."""
from __future__ import annotations

import sys
from pathlib import Path


def diagnose(cfg, probe: bool = False) -> int:
    """Print the checks' findings for a composed config (and with ``probe`` the network probe's);
    0, or 2 when the run would be refused."""
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
    if run.refusals:
        return 2
    return probe_network(cfg) if probe else 0


def probe_network(cfg) -> int:
    """Start the run's job with the probe in every role (module docstring); 0 when every task
    reached every other, else 2. The probe's directory (beside the run's) is removed after."""
    import shutil
    import tempfile
    from dataclasses import asdict

    from pipeline.apps.train import job_plan
    from pipeline.launch import LocalLauncher, SlurmLauncher

    beside = Path(cfg.run.dir).resolve().parent  # on the run's (shared) filesystem
    beside.mkdir(parents=True, exist_ok=True)
    where = Path(tempfile.mkdtemp(prefix="tokenflow-probe-", dir=beside))
    try:
        plan = job_plan(cfg, where)
        for spec in plan.components.values():
            spec.entry, spec.max_restarts, spec.optional = "pipeline.launch.probe:probe", 0, False
        plan.config["probe"] = {"reach": asdict(cfg.cluster.network), "timeout_s": 60}
        launcher = LocalLauncher() if cfg.cluster.launcher == "local" else SlurmLauncher()
        try:
            results = launcher.launch(plan, where).wait(timeout_s=cfg.run.timeout_s)
        except Exception as exc:  # a task failed or the job never ran: no reachability to report
            print(f"refused: [probe] the probe job did not complete: {exc}")
            return 2
        failed = 0
        for reports in results.values():
            for r in reports:
                bad = {peer: why for peer, why in r["reach"].items() if why != "ok"}
                failed += len(bad)
                print(f"[probe] {r['role']}.{r['rank']} on {r['node']} listening on {r['listened']}: reaches "
                      f"{', '.join(p for p in r['reach'] if p not in bad) or 'nobody'}"
                      + "".join(f"\nrefused: [probe] {r['role']}.{r['rank']} on {r['node']} cannot reach "
                                f"{peer}: {why}" for peer, why in bad.items()))
        return 2 if failed else 0
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    import hydra
    from omegaconf import OmegaConf

    from pipeline.apps.train import CONFIGS
    from pipeline.config import register

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    probe = "--probe" in argv
    argv = [a for a in argv if a != "--probe"]
    register()
    status: list[int] = []

    @hydra.main(config_path=str(CONFIGS), config_name="train", version_base=None)
    def app(dcfg) -> None:
        status.append(diagnose(OmegaConf.to_object(dcfg), probe))

    sys.argv = ["tokenflow doctor", *argv, "hydra.output_subdir=null", "hydra/job_logging=none",
                "hydra/hydra_logging=none"]
    app()
    return status[0] if status else 2
