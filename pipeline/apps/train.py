"""``tokenflow train [overrides]``: compose the config, launch the roles, follow the run.

With no arguments this is the built-in demo: a tiny model warm-started on the sort task, then
trained by asynchronous GRPO with the trainer and a vLLM generator as separate local processes.
The same command on the same run directory (``run.name``) resumes it; ``-m`` sweeps (Hydra
multirun with its basic launcher), one run directory per point. With ``cluster=slurm`` every run is
ONE heterogeneous job (trainer ranks + orchestrator, generators), so a sweep submits one job per
point (heterogeneous jobs cannot be job arrays, hence no ``hydra/launcher=submitit_slurm``);
``run.detach=true`` returns right after submitting (then ``tokenflow status RUN_DIR``). A sweep
ends with its points compared (`pipeline.apps.ops.compare.report_sweep`: table + SWEEP_DIR/compare.png).

Invariants:
- nothing starts before the config is validated and, on resume, checked against the config the
  run directory started with (`pipeline.config.check_resume_compatible`);
- the launcher process never trains: it starts the roles (local processes or one Slurm
  heterogeneous job), shows progress, mirrors metrics to TensorBoard and the chosen trackers
  (`logger`) and draws the final plot;
- SIGTERM, SIGINT and SIGHUP (``timeout``, a process manager, a closed login session, Ctrl-C) stop
  the whole run as ``tokenflow cancel`` does (`pipeline.apps.ops.cancel_run`: the trainer
  checkpoints at its step boundary, every task's process group and every joined generator job
  is ended, SIGKILL after ``CANCEL_GRACE_S``); the command returns once nothing of the run is left,
  with 128 + the signal's number. A signal that comes while the roles are being launched is taken
  once the launch returned (nothing started is left running); further signals while the run
  stops change nothing;
- a failed role stops the run (the launcher stops the others) and its log tail is shown; a plan the
  cluster cannot run (partition, CPUs, memory, GPUs, nodes) or that sbatch refuses is reported
  before anything starts (exit status 2).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

from pipeline.config import TokenflowConfig, check_resume_compatible, register, validate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
COMPLETE = "COMPLETE"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals to `tokenflow train` that stop the run it follows (module docstring)."""
log = logging.getLogger("tokenflow.train")


class StopSignals:
    """Records the first stop signal that arrived (the handlers only record it: a stop in the middle
    of a launch or of a cancel must not leave either half done); restores the old handlers on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, sig: int, frame) -> None:
        self.received = self.received or sig

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def job_plan(cfg: TokenflowConfig, run_dir: Path):
    from dataclasses import replace

    from pipeline.launch.network import network_env
    from pipeline.launch.plan import JobPlan, scorer_components

    c = cfg.cluster
    trainer = replace(c.trainer, nodes=1 if c.launcher == "local" else c.trainer.nodes,
                      tasks_per_node=c.trainer_ranks if c.launcher == "local" else c.trainer.tasks_per_node)
    generator = replace(c.generator, nodes=1 if c.launcher == "local" else c.generator.nodes,
                        tasks_per_node=c.generators if c.launcher == "local" else c.generator.tasks_per_node)
    if trainer.num_tasks != c.trainer_ranks or (c.generators and generator.num_tasks != c.generators):
        raise ValueError(f"cluster: trainer nodes x tasks_per_node = {trainer.num_tasks} must equal "
                         f"trainer_ranks ({c.trainer_ranks}) and generator nodes x tasks_per_node = "
                         f"{generator.num_tasks} must equal generators ({c.generators})")
    if c.mpi and c.launcher == "slurm":
        import importlib.util
        if importlib.util.find_spec("mpi4py") is None:
            raise ValueError(f"cluster.mpi={c.mpi} needs mpi4py in this environment (pip install "
                             "'tokenflow[mpi]', with Open MPI's headers installed); or leave cluster.mpi unset")
    components = {"trainer": trainer, "generator": generator} if c.generators else {"trainer": trainer}
    components.update(scorer_components(cfg))
    plan = JobPlan(name=f"tokenflow-{cfg.run.name}", components=components,
                   config={"run_dir": str(run_dir)}, max_requeues=c.max_requeues,
                   signal_delay_s=c.signal_delay_s, stop_grace_s=c.stop_grace_s,
                   mpi=c.mpi if c.launcher == "slurm" else None, env=network_env(c.network))
    if c.launcher == "local":  # one node: disjoint GPU ranges per component
        from pipeline.launch.gpus import colocated_roles, local_gpu_layout
        local_gpu_layout(plan, colocated_roles(cfg))
    return plan


def prepare_run_dir(cfg: TokenflowConfig) -> Path:
    from omegaconf import OmegaConf

    from pipeline.run_dir import save_run_config
    from pipeline.run_files import CONFIG_FILE

    run_dir = Path(cfg.run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)  # the run's files (secret, rollouts, checkpoints, logs) are the user's alone
    cfg.run.dir = str(run_dir)
    path = run_dir / CONFIG_FILE
    if path.exists():
        old = OmegaConf.to_container(OmegaConf.load(path))
        new = OmegaConf.to_container(OmegaConf.structured(cfg))
        check_resume_compatible(old, new, run_dir)
    save_run_config(run_dir, cfg)
    return run_dir


def train(cfg: TokenflowConfig) -> int:
    try:
        validate(cfg)
    except (ValueError, FileNotFoundError) as exc:  # a bad config or model: refused before anything starts
        print(f"tokenflow: cannot start the run: {exc}", file=sys.stderr)
        return 2
    from pipeline.doctor import report, run_checks
    checked = run_checks(cfg, job_plan(cfg, Path(cfg.run.dir).resolve()))
    if checked.refusals:  # the doctor's checks (`tokenflow doctor` prints them all)
        print(f"tokenflow: cannot start the run:\n{report(checked)}", file=sys.stderr)
        return 2
    from pipeline.apps.ops import still_running
    running = still_running(Path(cfg.run.dir).resolve())
    if running:
        print(f"tokenflow: {cfg.run.dir} is still running as {running}: follow it with `tokenflow status "
              f"{cfg.run.dir}` or stop it with `tokenflow cancel {cfg.run.dir}` before resuming it", file=sys.stderr)
        return 2
    run_dir = prepare_run_dir(cfg)
    done = run_dir / COMPLETE
    if done.exists():
        finished = int(done.read_text().split()[0])
        if finished >= cfg.run.steps:
            print(f"{run_dir} already finished {finished} steps; see {run_dir / 'training.png'} "
                  f"(choose another run.name to start a new run, or ask for more run.steps)")
            return 0
        done.unlink()  # more steps asked for: resume from the last checkpoint
    from pipeline.rollout_log.format import (
        LogFullError, UnsupportedFilesystemError, check_log_filesystem)
    from pipeline.run_files import ROLLOUTS_DIR
    try:  # before any role starts: none of them may wait for an orchestrator that cannot log
        check_log_filesystem(run_dir / ROLLOUTS_DIR)
    except (UnsupportedFilesystemError, LogFullError) as exc:
        print(f"tokenflow: cannot start the run: {exc}", file=sys.stderr)
        return 2
    from pipeline.launch import LaunchError, LocalLauncher, SlurmLauncher
    from pipeline.observe.plots import plot_run

    plan = job_plan(cfg, run_dir)
    launcher = LocalLauncher() if cfg.cluster.launcher == "local" else SlurmLauncher()
    print(f"tokenflow: run directory {run_dir} ({cfg.cluster.launcher}: {cfg.cluster.trainer_ranks} "
          f"trainer rank(s), {cfg.cluster.generators} generator(s)); logs in {run_dir / 'logs'}",
          flush=True)
    with StopSignals() as stop:
        try:
            run = launcher.launch(plan, run_dir)
        except LaunchError as exc:
            print(f"tokenflow: cannot launch the run: {exc}", file=sys.stderr)
            return 2
        if getattr(run, "job_id", None):
            print(f"tokenflow: submitted Slurm heterogeneous job {run.job_id} "
                  f"({' + '.join(plan.components)})", flush=True)
        if cfg.run.detach and not stop.received:
            print(f"tokenflow: detached; follow with `tokenflow status {run_dir}`, stop with `tokenflow cancel "
                  f"{run_dir}`, logs in {run_dir / 'logs'}", flush=True)
            return 0
        follow(cfg, run, run_dir, stop)
        if stop.received:
            from pipeline.apps.ops import cancel_run
            name = signal.Signals(stop.received).name
            print(f"\ntokenflow: {name} received; stopping the run (the same command resumes it)",
                  file=sys.stderr, flush=True)
            print(f"tokenflow: {cancel_run(run_dir)}", file=sys.stderr, flush=True)
            if cfg.cluster.launcher == "local":  # reap the tasks (cancel_run ended them)
                run.cancel()
            return 128 + stop.received
    state = "COMPLETED" if run.lingered else run.state()  # lingered: every task succeeded (cancelled after)
    trainer_result = (run.read_results().get("trainer") or [None])[0]
    if state != "COMPLETED" or not trainer_result or not trainer_result["ok"] or trainer_result.get("stopped"):
        from pipeline.launch.base import log_tail
        print(f"tokenflow: the run {state.lower()}", file=sys.stderr)
        for role, spec in plan.components.items():
            for rank in range(spec.num_tasks):
                print(f"--- {role}.{rank} (last lines) ---\n{log_tail(run_dir, role, rank)}", file=sys.stderr)
        return 1
    png = plot_run(run_dir)
    (run_dir / COMPLETE).write_text(f"{cfg.run.steps} steps, finished {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"tokenflow: done; learning curve in {png}")
    return 0


def follow(cfg: TokenflowConfig, run, run_dir: Path, stop: StopSignals) -> None:
    """Show progress and mirror metrics until the run is done or a stop signal arrived."""
    from pipeline.observe.progress import ProgressDisplay

    progress = ProgressDisplay(run_dir, cfg.run.steps) if cfg.run.progress else None
    mirror = trackers = None
    if "tensorboard" in cfg.logger:
        from pipeline.observe.tensorboard import TensorBoardMirror
        mirror = TensorBoardMirror(run_dir)
    if set(cfg.logger) - {"tensorboard"}:
        from pipeline.observe.trackers import TrackerMirror
        trackers = TrackerMirror(run_dir, list(cfg.logger), cfg.tracking)
    state, submitted = None, time.monotonic()
    try:
        while not stop.received and not run.done() and not run.end_lingering():
            for _ in range(5 if cfg.cluster.launcher == "local" else 15):
                if stop.received:
                    break
                time.sleep(0.2)
            if cfg.cluster.launcher == "slurm" and run.state() != state:
                state = run.state()
                print(f"tokenflow: job {run.job_id} {state} ({time.monotonic() - submitted:.0f} s after "
                      f"submission)", file=sys.stderr, flush=True)
            if progress:
                progress.update()
            if mirror:
                mirror.update()
            if trackers:
                trackers.update()
    finally:
        if progress:
            progress.close()
        if mirror:
            from pipeline.apps.ops.summary import run_hparams
            mirror.close(hparams=run_hparams(run_dir))
        if trackers:
            trackers.close()


def main(argv: list[str] | None = None) -> int:
    """Entry of ``tokenflow train``: Hydra parses the overrides (``-m`` for sweeps)."""
    import hydra
    from omegaconf import OmegaConf

    register()
    argv = sys.argv[1:] if argv is None else argv
    status: list[int] = []
    sweep_dirs: list[str] = []

    @hydra.main(config_path=str(CONFIGS), config_name="train", version_base=None)
    def app(dcfg) -> None:
        from hydra.core.hydra_config import HydraConfig
        if HydraConfig.get().mode.name == "MULTIRUN":
            sweep_dirs.append(HydraConfig.get().sweep.dir)
        status.append(train(OmegaConf.to_object(dcfg)))

    sys.argv = ["tokenflow train", *argv]
    try:
        app()
    finally:
        if sweep_dirs:  # end of a sweep (also when a point failed): its points side by side
            from pipeline.apps.ops.compare import report_sweep
            report_sweep(Path(sweep_dirs[0]))
    return max(status, default=1)
