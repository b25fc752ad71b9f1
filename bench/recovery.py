"""Time to training again after a kill -9 of each kind of process, with one and with two generators.

For each generator count, one local run of the tiny model (real engines, trainer and launcher) gets,
once it trains, a ``kill -9`` of: the orchestrator, generator 0's vLLM EngineCore, generator 0's
(restarted) role process, then trainer rank 0, which stops the run; the same run is then launched
again, as the same `tokenflow train` command would. Each kill's figure is the seconds from the kill
to training again: the longest stretch without a trained step from the kill to the next kill (for
the trainer: until the relaunched run trained; a batch the trainer held already may make a step
right after the kill, so the first step after it says little, and the run goes on until a second
one: the trainer holds one batch at a time, so that step's batch came after the recovery). It uses the process finders of
`tests/apps/test_weight_recovery.py` (`tests/support/chaos.py`). With two
generators a generator's or engine's death should cost about a step (the other trains on); with
one, the restarted engine's cold start (``cold_start_s``: from the role's restart to its first
weights loaded).

Prints one line per kill, then one JSON line: per count and role the seconds, and the ratio of two
generators' to one's.

    python bench/recovery.py --smoke     # one generator, the orchestrator killed once
    python bench/recovery.py --quick     # no trainer kill (its figure is a whole relaunch): ~8 min on 2 cores
    python bench/recovery.py --generators 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "tests" / "support"))  # chaos.py (appended: bench/leftovers.py, not support/leftovers.py)

ROLES = ("orchestrator", "engine", "generator", "trainer")


def _config(run: Path, generators: int, steps: int):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipeline.apps.train import CONFIGS
    from pipeline.config import register, validate

    register()
    overrides = [f"run.dir={run}", "run.name=recovery", f"run.steps={steps}", "run.eval_every=0",
                 "run.mismatch_every=0", "run.progress=false", "logger=[]", "run.checkpoint_every=2",
                 f"cluster.generators={generators}", "orchestrator.groups_per_step=4", "orchestrator.group_size=4",
                 "model.warmstart_steps=0", "generator.max_tokens=16", "generator.weight_timeout_s=30",
                 "run.timeout_s=300"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = OmegaConf.to_object(compose("train", overrides=overrides))
    validate(cfg)
    return cfg


def _cold_start_s(run: Path, restart: int) -> float | None:
    """Seconds from generator 0's ``restart``-th role start to its first weights loaded (log times)."""
    text = (run / "logs/generator.0.out").read_text(errors="replace")
    _, _, after = text.partition(f"(restart {restart}) at ")
    if not after:
        return None
    start = time.mktime(time.strptime(after[:19], "%Y-%m-%dT%H:%M:%S"))
    for line in after.splitlines():
        if " generator INFO loaded version " in line:
            return round(time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
                         - start, 1)
    return None


def _longest_pause(step_times: list[float], t_kill: float, until: float) -> float | None:
    """Seconds of the longest stretch without a trained step from the kill at ``t_kill`` to ``until``
    (the next kill, or the last step): the time to training again, also where a batch the trainer
    already held made a first step right after the kill."""
    times = [t for t in step_times if t_kill < t <= until]
    return round(max(b - a for a, b in zip([t_kill, *times], times)), 1) if times else None


def measure(generators: int, steps: int, root: Path, roles: tuple[str, ...]) -> dict:
    from chaos import (Chaos, engine_process, last_step, loaded_after_restart, orchestrator_process, role_process,
                       wait_for)
    from pipeline.apps.train import job_plan, prepare_run_dir
    from pipeline.launch import LocalLauncher, TaskFailed
    from pipeline.metrics import read_metrics

    run = root / f"gen{generators}"
    cfg = _config(run, generators, steps)
    prepare_run_dir(cfg)
    chaos = Chaos(run, list(roles), seed=0, first=3, spread=1)
    kills = dict(zip(roles, chaos.kills))
    gen_rank = 1  # global rank of generator 0 (trainer.0 first)
    launched = LocalLauncher().launch(job_plan(cfg, run), run)
    chaos.running = lambda: launched.state() == "RUNNING"
    try:
        chaos.strike(kills["orchestrator"], lambda: orchestrator_process(run))
        if "engine" in kills:
            chaos.strike(kills["engine"], lambda: engine_process(run, gen_rank))
            wait_for(lambda: loaded_after_restart(run, "generator", 0, 1), 900, "the restarted generator",
                     chaos.running)
        if "generator" in kills:
            gen = kills["generator"]
            gen.at_step = max(gen.at_step, last_step(run) + 1)
            chaos.strike(gen, lambda: role_process(run, gen_rank))
            wait_for(lambda: loaded_after_restart(run, "generator", 0, 2), 900, "the restarted generator",
                     chaos.running)
        last = chaos.kills[-1]  # two steps after it: the first may be the batch the trainer held at the kill
        wait_for(lambda: sum(r["t"] > last.t for r in read_metrics(run, "train_step")) >= 2, 900,
                 "training after the last kill", chaos.running)
        if "trainer" in kills:
            trainer = kills["trainer"]
            trainer.at_step = max(trainer.at_step, last_step(run) + 1)
            chaos.strike(trainer, lambda: role_process(run, 0))
            try:
                launched.wait(timeout_s=120)
            except TaskFailed:
                pass
            launched = LocalLauncher().launch(job_plan(cfg, run), run)  # the same command again
            chaos.running = lambda: launched.state() == "RUNNING"
            wait_for(lambda: any(r["t"] > trainer.t for r in read_metrics(run, "train_step")), 900,
                     "training after the relaunch", chaos.running)
    finally:
        launched.cancel(grace_s=30)
    steps = [r["t"] for r in read_metrics(run, "train_step")]
    ends = [k.t for k in chaos.kills[1:]] + [steps[-1]]
    out = {k.target: _longest_pause(steps, k.t, end) for k, end in zip(chaos.kills, ends)}
    out["cold_start_s"] = [_cold_start_s(run, 1), _cold_start_s(run, 2)] if "engine" in kills else [None, None]
    for k in chaos.kills:
        print(f"{generators} generator(s): kill -9 {k.target} after step {k.step}: {out[k.target]} s "
              f"without training", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="no trainer kill (its figure is a whole relaunch)")
    p.add_argument("--smoke", action="store_true", help="one generator, only the orchestrator killed (seconds of "
                   "recovery after an engine start; the same keys)")
    p.add_argument("--generators", type=int, nargs="*", default=[1, 2], help="generator counts (default 1 2)")
    p.add_argument("--steps", type=int, default=1_000_000,
                   help="steps of each run (it is cancelled after the kills; with two generators the other one "
                   "trains several steps/s meanwhile: 3000 steps may end a run before a restart's cold start does)")
    args = p.parse_args()
    roles = ROLES[:1] if args.smoke else ROLES[:3] if args.quick else ROLES
    counts = [1] if args.smoke else args.generators
    result: dict = {"bench": "recovery", "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
                    "generators": {}, "two_over_one": None}
    with tempfile.TemporaryDirectory(prefix="tokenflow-recovery-") as tmp:
        for n in counts:
            result["generators"][str(n)] = measure(n, args.steps, Path(tmp), roles)
    by = result["generators"]
    if "1" in by and "2" in by:
        result["two_over_one"] = {r: round(by["2"][r] / by["1"][r], 2) if by["1"][r] and by["2"][r] else None
                                  for r in roles}
    print(json.dumps(result))


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    with no_process_left():
        main()
