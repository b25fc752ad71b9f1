"""``tokenflow status RUN_DIR [--json]`` and ``tokenflow cancel RUN_DIR``: operate a run from its directory.

Everything is read from the run directory and the launcher it records, never from a process that
must still be alive: `RUN/launch/launches.jsonl` (the latest launch: Slurm job id or local task
pids), `RUN/launch/plan.json` (the components, in heterogeneous-job order), `RUN/metrics/`
(step, policy versions, buffer depth, evaluations), `RUN/results/` and `RUN/logs/` (errors).

Worked example (a Slurm run after one requeue):

    run      runs/exp1  (slurm job 123, attempt 1)
    trainer    RUNNING  node1        1 task(s)   log runs/exp1/logs/trainer.0.out
    generator  RUNNING  node2        1 task(s)   log runs/exp1/logs/generator.0.out
    step     4/6  policy version 4 (generators at 4)  buffer 12 groups  staleness max 1
    eval     step 3: accuracy 0.41 (n=200)
    error    none

Slurm names the components of heterogeneous job N as `N+0`, `N+1`, ... in the plan's order;
`status` reports each one's state (from `sacct`, with `squeue`'s pending reason). `cancel` runs
`scancel N` (every component) or, for a local run, SIGTERMs each task's process group.
`status` of a sweep directory lists every point (see `pipeline.apps.ops.sweep`).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from pipeline.launch.local import CANCEL_GRACE_S
from pipeline.launch.task import log_path
from pipeline.run_files import CONFIG_FILE, RESULTS_DIR

LAUNCHES = "launch/launches.jsonl"
PLAN = "launch/plan.json"
#: Component states in which nothing of it runs: Slurm's final states, local EXITED, and UNKNOWN
#: (neither sacct nor squeue knows the job any more).
STOPPED_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                  "DEADLINE", "EXITED", "UNKNOWN")


def latest_launch(run_dir: Path) -> Dict[str, Any]:
    path = run_dir / LAUNCHES
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {run_dir} was never launched (or is not a run directory)")
    return json.loads(path.read_text().splitlines()[-1])


def _components(run_dir: Path) -> List[Dict[str, Any]]:
    plan = json.loads((run_dir / PLAN).read_text())
    return [{"role": role, "tasks": spec["nodes"] * spec["tasks_per_node"]}
            for role, spec in plan["components"].items()]


def _alive(pid: int, run_dir: Path) -> bool:
    """Whether local task `pid` of `run_dir` still runs (its command line names the run directory,
    so a recycled pid is not mistaken for the task)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return any(Path(a).resolve() == run_dir for a in args if a.startswith("/"))


def _last(run_dir: Path, kind: str, role: Optional[str] = None) -> Optional[Dict[str, Any]]:
    from pipeline.metrics import read_metrics

    last = None
    for rec in read_metrics(run_dir, kind):
        if role is None or rec.get("role") == role:
            last = rec
    return last


def latest_attempt(run_dir: Path, role: str) -> Optional[int]:
    """The attempt of the latest start of `role` rank 0 (launches and Slurm requeues), from its log header."""
    path = log_path(run_dir, role, 0)
    if not path.exists():
        return None
    heads = [line.split()[3] for line in path.read_text(errors="replace").splitlines()
             if line.startswith(f"=== {role}.0 attempt ")]
    return int(heads[-1]) if heads else None


def last_error(run_dir: Path) -> Optional[str]:
    """The last line of the newest failed task's error, else None."""
    failed = []
    for path in (run_dir / RESULTS_DIR).glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not record.get("ok", True):
            failed.append((path.stat().st_mtime, path.stem, record.get("error", "").strip().splitlines()[-1:]))
    if not failed:
        return None
    _, task, line = max(failed)
    return f"{task}: {line[0] if line else 'failed'}"


def run_status(run_dir: Path) -> Dict[str, Any]:
    """Everything `tokenflow status` shows, as one JSON-able dict."""
    run_dir = Path(run_dir).resolve()
    launch = latest_launch(run_dir)
    components = _components(run_dir)
    launcher = launch["launcher"]
    if launcher in ("slurm", "sbatch"):  # sbatch: slurm/train.sbatch, submitted by hand
        from pipeline.launch.slurm import slurm_states

        states = slurm_states(str(launch["job_id"]))
        for k, comp in enumerate(components):
            comp.update(states.get(k, {"state": "UNKNOWN", "nodes": "", "reason": ""}))
    else:
        pids = launch.get("pids") or []
        index = 0
        for comp in components:
            mine = pids[index:index + comp["tasks"]]
            index += comp["tasks"]
            alive = sum(_alive(p, run_dir) for p in mine)
            comp.update(state="RUNNING" if alive else "EXITED", nodes="localhost", pids=mine, alive=alive)
    for comp in components:
        comp["logs"] = [str(log_path(run_dir, comp["role"], r)) for r in range(comp["tasks"])]
    step, orch, ev = _last(run_dir, "train_step"), _last(run_dir, "orchestrator"), _last(run_dir, "eval")
    from pipeline.metrics import latest_by_step, mismatch_points, read_metrics
    generators: Dict[str, int] = {}
    for rec in read_metrics(run_dir, "generator"):
        generators[rec["role"]] = rec.get("version")
    trackers = {rec["tracker"]: {"failures": rec["failures"], "error": rec.get("error")}
                for rec in read_metrics(run_dir, "tracker")}  # pipeline.observe.trackers
    cfg_steps = None
    if (run_dir / CONFIG_FILE).exists():
        from omegaconf import OmegaConf
        cfg_steps = OmegaConf.load(run_dir / CONFIG_FILE).get("run", {}).get("steps")
    return {
        "run_dir": str(run_dir), "launcher": launcher, "job_id": launch.get("job_id"),
        "launch_index": launch.get("launch_index"), "attempt": latest_attempt(run_dir, components[0]["role"]),
        "complete": (run_dir / "COMPLETE").exists(),
        "components": components,
        "steps_done": step["step"] + 1 if step else 0, "steps": cfg_steps,
        "version": step["version"] if step else None,
        "generator_versions": generators,
        "buffer_groups": orch.get("buffer_groups") if orch else None,
        "in_flight_groups": orch.get("in_flight") if orch else None,
        "staleness_max": step.get("staleness_max") if step else None,
        "last_eval": {k: ev.get(k) for k in ("step", "version", "accuracy", "n")} if ev else None,
        **mismatch_points(latest_by_step(list(read_metrics(run_dir, "train_step")))),
        "last_error": last_error(run_dir),
        "tracker_failures": trackers,
        "generator_jobs": _generator_jobs(run_dir),
        "log_damage": _log_damage(run_dir),
    }


def _log_damage(run_dir: Path) -> List[str]:
    """Damage the rollout log records (`pipeline.rollout_log.scan.recorded_damage`)."""
    from pipeline.rollout_log.scan import recorded_damage
    from pipeline.run_files import ROLLOUTS_DIR
    log_dir = Path(run_dir) / ROLLOUTS_DIR
    return recorded_damage(log_dir) if log_dir.is_dir() else []


def _generator_jobs(run_dir: Path) -> List[Dict[str, Any]]:
    """Every generator job of the run and its generators (`pipeline.launch.generator_jobs`)."""
    from pipeline.launch.generator_jobs import jobs_status
    return jobs_status(run_dir) if (run_dir / CONFIG_FILE).exists() else []


def still_running(run_dir: Path) -> Optional[str]:
    """What of the run's latest launch still runs ("slurm job 123 RUNNING", "local pids [..]"), else None."""
    if not (Path(run_dir) / LAUNCHES).exists():
        return None
    components = run_status(run_dir)["components"]
    active = [f"{c['role']} {c['state']}" for c in components if c["state"] not in STOPPED_STATES]
    if not active:
        return None
    launch = latest_launch(Path(run_dir))
    where = f"Slurm job {launch['job_id']}" if launch.get("job_id") else f"local pids {launch.get('pids')}"
    return f"{where} ({', '.join(active)})"


def format_status(s: Dict[str, Any]) -> str:
    where = f"slurm job {s['job_id']}" if s["launcher"] in ("slurm", "sbatch") else "local processes"
    lines = [f"run        {s['run_dir']}  ({where}, attempt {s['attempt']}"
             f"{', complete' if s['complete'] else ''})"]
    for c in s["components"]:
        extra = f" ({c['reason']})" if c.get("reason") else ""
        lines.append(f"{c['role']:<10} {c['state'] + extra:<24} {c['nodes'] or '-':<12} {c['tasks']} task(s)"
                     f"   log {c['logs'][0]}")
    gens = ", ".join(f"{k} at {v}" for k, v in sorted(s["generator_versions"].items())) or "none reported"
    lines.append(f"step       {s['steps_done']}/{s['steps']}  policy version {s['version']} ({gens})  "
                 f"buffer {s['buffer_groups']} groups, {s['in_flight_groups']} in flight  "
                 f"staleness max {s['staleness_max']}")
    ev = s["last_eval"]
    lines.append("eval       " + (f"step {ev['step']}: accuracy {ev['accuracy']:.3f} (n={ev['n']})" if ev else "none yet"))
    if s.get("mismatch_first") is None:
        lines.append("mismatch   none measured yet")
    else:
        last = "" if s["mismatch_last_step"] == s["mismatch_first_step"] else \
            f", step {s['mismatch_last_step']}: {s['mismatch_last']:.2e}"
        lines.append(f"mismatch   step {s['mismatch_first_step']}: {s['mismatch_first']:.2e}{last} "
                     "(mean |train - generator| logprob)")
    lines.append(f"error      {s['last_error'] or 'none'}")
    lines += [f"log damage {d}" for d in s.get("log_damage") or []]
    for name, t in sorted((s.get("tracker_failures") or {}).items()):
        lines.append(f"tracker    {name}: {t['failures']} failure(s), last {t['error']} (the run goes on)")
    from pipeline.launch.generator_jobs import format_jobs
    lines += format_jobs(s.get("generator_jobs") or [])
    return "\n".join(lines)


def cancel_run(run_dir: Path, grace_s: float = CANCEL_GRACE_S) -> str:
    """Stop every task of the run's latest launch and of the generator jobs that joined it; returns
    what was done.

    Slurm: ``scancel`` (Slurm's KillWait escalates). Local: SIGTERM to the process group of every
    task still running (each task leads its own; the pid must still name a task of this run), then
    wait until no process of those groups is left; after ``grace_s`` the rest get SIGKILL, so a role
    that does not stop at its step boundary cannot keep the run alive."""
    from pipeline.launch.generator_jobs import job_records
    from pipeline.supervise import end_groups

    run_dir = Path(run_dir).resolve()
    run, joined = latest_launch(run_dir), job_records(run_dir)
    done = []
    if run.get("job_id"):
        job_id = str(run["job_id"])
        out = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"scancel {job_id} failed: {out.stderr.strip()}")
        done.append(f"scancel {job_id} (every component of the heterogeneous job)")
    for job in joined:  # generator jobs that joined the run: gone already, most of them
        if job.get("job_id"):
            subprocess.run(["scancel", str(job["job_id"])], capture_output=True, timeout=30)
    groups = [pid for launch in (run, *joined) if not launch.get("job_id")
              for pid in launch.get("pids") or [] if _alive(pid, run_dir)]
    if not run.get("job_id") or groups:
        done.append(f"SIGTERM to the process groups of {len(groups)} running local task(s)")
        killed, unkillable = end_groups(groups, grace_s)
        if killed:
            done.append(f"{len(killed)} process(es) still running after {grace_s:g} s got SIGKILL: {killed}")
        if unkillable:
            done.append(f"still present after it: {unkillable}")
        elif groups and not killed:
            done.append("every task stopped")
    return "; ".join(done)


def sweep_status(sweep_dir: Path) -> Dict[str, Any]:
    """Every point of a sweep with its run's status (`run_status`) and differing keys."""
    from pipeline.apps.ops.sweep import differing_keys, run_config, sweep_points

    points = sweep_points(sweep_dir)
    configs = [run_config(p) for p in points]
    keys = differing_keys(configs)
    rows = []
    for point, cfg in zip(points, configs):
        try:
            status: Optional[Dict[str, Any]] = run_status(point)
        except FileNotFoundError:
            status = None  # never launched
        rows.append({"point": point.name, "run_dir": str(point.resolve()),
                     "overrides": {k: cfg.get(k) for k in keys}, "status": status})
    return {"sweep_dir": str(Path(sweep_dir).resolve()), "keys": keys, "points": rows}


def status_main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenflow status", description="components, Slurm states, step, "
                                     "policy versions, buffer depth, last eval and last error of a run")
    parser.add_argument("run_dir", type=Path, help="a run directory, or a sweep directory (every point listed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    from pipeline.apps.ops.sweep import format_sweep_status, is_sweep_dir
    if is_sweep_dir(args.run_dir):
        sweep = sweep_status(args.run_dir)
        print(json.dumps(sweep) if args.json else format_sweep_status(sweep))
        return 0
    try:
        s = run_status(args.run_dir)
    except FileNotFoundError as exc:
        print(f"tokenflow status: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(s) if args.json else format_status(s))
    return 0


def cancel_main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenflow cancel", description="stop every component of a run "
                                     "(scancel, or SIGTERM to local tasks); the same train command resumes it")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--grace-s", type=float, default=CANCEL_GRACE_S, help="local runs: seconds the tasks get to stop "
                        "after SIGTERM before SIGKILL (Slurm: its KillWait)")
    args = parser.parse_args(argv)
    try:
        print(f"tokenflow cancel: {cancel_run(args.run_dir, args.grace_s)}")
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"tokenflow cancel: {exc}", file=sys.stderr)
        return 2
    return 0


