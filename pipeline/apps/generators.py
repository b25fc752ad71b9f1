"""``tokenflow generators RUN --count N [cluster=slurm] [cluster.generator.FIELD=VALUE ...]``: add N
generators to a running run, from their own job (`pipeline.launch.generator_jobs`).

Locally the generators are detached processes (this command returns once they are started);
with ``cluster=slurm`` they are one Slurm job (``cluster.generator.*``: partition, time_min,
cpus_per_task, mem_gb, tasks_per_node, ...). They join the weight group at the trainer's next
push, load the current weights and only then take work. A stop signal (``scancel``, the job's time
limit, ``kill -TERM -PID`` of a local task) makes them leave: their in-flight groups go back to
the orchestrator at once, the group shrinks at the next push (`docs/generator-jobs.md`). At its
time limit the job departs for good; ``--requeue`` has it requeued (``cluster.max_requeues``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenflow generators", description="add generators to a running "
                                     "run from their own job (local processes or one Slurm job)")
    parser.add_argument("run_dir", type=Path, help="the run directory of a running run")
    parser.add_argument("--count", type=int, default=1, help="generators to add (default 1)")
    parser.add_argument("--requeue", action="store_true", help="requeue the job at its time limit or on "
                        "preemption (up to cluster.max_requeues times; default: it departs for good)")
    parser.add_argument("overrides", nargs="*", help="cluster=local|slurm and cluster.generator.FIELD=VALUE "
                        "(default: the run's own cluster settings)")
    args = parser.parse_intermixed_args(argv)  # options may come before or after the overrides
    try:
        cfg = _config(args.run_dir, args.overrides)
        from pipeline.apps.ops import still_running
        if not still_running(args.run_dir.resolve()):
            raise ValueError(f"{args.run_dir} is not running (tokenflow status {args.run_dir})")
        from pipeline.launch.generator_jobs import start_job
        record = start_job(cfg, args.run_dir, args.count, requeue=args.requeue)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenflow generators: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # LaunchError (sbatch refused, the cluster cannot give it)
        from pipeline.launch import LaunchError
        if not isinstance(exc, LaunchError):
            raise
        print(f"tokenflow generators: cannot launch: {exc}", file=sys.stderr)
        return 2
    first, count = record["first_rank"], record["count"]
    where = f"Slurm job {record['job_id']}" if record.get("job_id") else f"local pids {record['pids']}"
    print(f"tokenflow generators: {record['job']} ({where}): generator(s) {first}..{first + count - 1} join "
          f"{args.run_dir}; logs {args.run_dir}/logs/generator.<rank>.out; `tokenflow status {args.run_dir}`")
    return 0


def _config(run_dir: Path, overrides: list[str]):
    """The run's own config with the generator job's overrides (only cluster.* may change)."""
    from omegaconf import OmegaConf

    from pipeline.run_dir import load_run_config
    cfg = OmegaConf.structured(load_run_config(run_dir))
    dotlist = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not (key == "cluster" or key.startswith("cluster.")):
            raise ValueError(f"override {item!r}: only cluster=local|slurm and cluster.FIELD=VALUE apply to "
                             f"a generator job (the run's other settings are the run's)")
        if key == "cluster":
            if value not in ("local", "slurm"):
                raise ValueError(f"cluster={value!r}: local or slurm")
            key = "cluster.launcher"
        dotlist.append(f"{key}={value}")
    return OmegaConf.to_object(OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist)))
