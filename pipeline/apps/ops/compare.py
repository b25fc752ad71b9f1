"""``tokenflow compare PATH... [--json | --csv] [--plot OUT.png]``: the runs of a sweep side by side.

PATH is a sweep directory (all its points), run directories, or glob patterns of either. One row
per run: the config keys whose values differ between the runs (keys of ``task`` and ``model``
first, marked ``!``: runs that differ there train or measure different things, so their
accuracies are not comparable), then final and best held-out accuracy (greedy pass@1, with the step
of the best), the final pass@k (a column only when a run has it, ``eval.samples`` = k > 0: "0.812 k=8"), the final greedy accuracy
of each named held-out set when a run has several (``acc <set>``),
mean batch reward of the last steps, steps done, trained tokens/s and trainer idle fraction of the
training loop (see `pipeline.apps.ops.summary`), mean staleness, dropped groups, wall time, and state
(running, pending, finished, or failed with its error). Runs still going are shown as they stand. ``--plot`` overlays every run's held-out accuracy
and reward curves, each labelled by its differing keys.

At the end of a local sweep (``tokenflow train -m``) `report_sweep` prints this table and writes
the overlay to ``SWEEP_DIR/compare.png``; a detached sweep gets `tokenflow status`'s listing of its
points instead (they have only just been submitted).

Example (``tokenflow train -m run.name=sw run.steps=4 run.eval_every=2 trainer.lr=1e-4,3e-4``)::

    run  trainer.lr  final acc  best acc@step  reward(last 5)  steps  tok/s  idle  stale  drops  wall  state
    0    0.0001      0.580      0.580@4        0.29            4/4    60     75%   0.50   0      5:33  finished
    1    0.0003      0.305      0.355@0        0.26            4/4    52     69%   0.50   0      2:50  finished
    best final held-out accuracy: run 0: trainer.lr=0.0001: 0.580 at step 4
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from pipeline.apps.ops import sweep_status
from pipeline.apps.ops.summary import LAST_STEPS, metric_summary, run_state
from pipeline.apps.ops.sweep import align, differing_keys, find_runs, format_sweep_status, run_config, sweep_points

#: Config groups whose differences make runs incomparable (another task or another starting policy).
INCOMPARABLE = ("task.", "model.")
PLOT_FILE = "compare.png"
#: Numeric columns of --csv (and the JSON), in table order.
NUMBERS = ("final_accuracy", "final_accuracy_step", "best_accuracy", "best_accuracy_step", "final_pass_at_k", "eval_k",
           "reward_last",
           "steps_done", "steps", "tokens_per_s", "trainer_idle_frac", "staleness_mean", "drops", "wall_s")


def _labels(run_dirs: List[Path]) -> List[str]:
    """Each run's path relative to the runs' common parent ("0", "1" for the points of one sweep)."""
    if len(run_dirs) == 1:
        return [run_dirs[0].name]
    common = os.path.commonpath([str(d) for d in run_dirs])
    return [os.path.relpath(d, common) for d in run_dirs]


def compare_runs(run_dirs: List[Path], last_steps: int = LAST_STEPS) -> Dict[str, Any]:
    """The comparison as one JSON-able dict: columns (differing keys, incomparable first), runs, best."""
    configs = [run_config(d) for d in run_dirs]
    keys = differing_keys(configs)
    incomparable = [k for k in keys if k.startswith(INCOMPARABLE)]
    columns = incomparable + [k for k in keys if k not in incomparable]
    runs = []
    for run_dir, cfg, label in zip(run_dirs, configs, _labels(run_dirs)):
        state, error, status = run_state(run_dir)
        runs.append({"run": label, "run_dir": str(run_dir), "overrides": {k: cfg.get(k) for k in columns},
                     "state": state, "error": error, "job_id": status.get("job_id"), "steps": cfg.get("run.steps"),
                     **metric_summary(run_dir, running=state in ("running", "pending"), last_steps=last_steps)})
    scored = [r for r in runs if r["final_accuracy"] is not None]
    best = max(scored, key=lambda r: r["final_accuracy"])["run"] if scored else None
    return {"columns": columns, "incomparable": incomparable, "last_steps": last_steps, "best": best, "runs": runs}


def _value(v: Any) -> str:
    if v is None:
        return "?"
    return f"{v:g}" if isinstance(v, float) else str(v)


def run_label(run: Dict[str, Any], with_keys: bool = True) -> str:
    """"1: trainer.lr=0.0003" (the run and its differing keys; without keys: "1: 0.0003"), or the
    run alone if none differ."""
    values = ", ".join(f"{k}={_value(v)}" if with_keys else _value(v) for k, v in run["overrides"].items())
    return f"{run['run']}: {values}" if values else run["run"]


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _duration(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _rate(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}")


def _sets(result: Dict[str, Any]) -> List[str]:
    """Held-out sets to show one by one: those of runs evaluated on several (data sources aside)."""
    names: List[str] = []
    for r in result["runs"]:
        own = [k for k in r["final_by_set"] if not k.startswith("source/")]
        names += [k for k in own if len(own) > 1 and k not in names]
    return names


def format_table(result: Dict[str, Any]) -> str:
    marked = [k + ("!" if k in result["incomparable"] else "") for k in result["columns"]]
    sets = _sets(result)
    with_k = any(r["final_pass_at_k"] is not None for r in result["runs"])
    header = ["run", *marked, "final acc", "best acc@step", *(["pass@k"] if with_k else []), *[f"acc {s}" for s in sets],
              f"reward(last {result['last_steps']})", "steps", "tok/s", "idle", "stale", "drops", "wall", "state"]
    rows = [header]
    for r in result["runs"]:
        best = "-" if r["best_accuracy"] is None else f"{r['best_accuracy']:.3f}@{r['best_accuracy_step']}"
        passk = "-" if r["final_pass_at_k"] is None else f"{r['final_pass_at_k']:.3f} k={r['eval_k']}"
        state = r["state"] + (f": {r['error']}" if r["error"] else "")
        rows.append([r["run"], *[_value(r["overrides"][k]) for k in result["columns"]],
                     _num(r["final_accuracy"], ".3f"), best, *([passk] if with_k else []),
                     *[_num(r["final_by_set"].get(s, {}).get("accuracy"), ".3f") for s in sets],
                     _num(r["reward_last"], ".2f"),
                     f"{r['steps_done']}/{_value(r['steps'])}", _rate(r["tokens_per_s"]),
                     _num(None if r["trainer_idle_frac"] is None else 100 * r["trainer_idle_frac"], ".0f")
                     + ("%" if r["trainer_idle_frac"] is not None else ""),
                     _num(r["staleness_mean"], ".2f"), _value(r["drops"]) if r["drops"] is not None else "-",
                     _duration(r["wall_s"]), state])
    lines = align(rows)
    if result["best"] is not None:
        best = next(r for r in result["runs"] if r["run"] == result["best"])
        name = run_label(best) if len(result["columns"]) <= 3 else best["run"]
        lines.append(f"best final held-out accuracy: run {name}: {best['final_accuracy']:.3f} "
                     f"at step {best['final_accuracy_step']}")
    if result["incomparable"]:
        lines.append(f"note: the runs differ in {', '.join(result['incomparable'])} (marked !): they train or "
                     f"measure different things, so their accuracies are not comparable")
    return "\n".join(lines)


def to_csv(result: Dict[str, Any]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["run", *result["columns"], *NUMBERS, "state", "error", "run_dir"])
    for r in result["runs"]:
        writer.writerow([r["run"], *[r["overrides"][k] for k in result["columns"]], *[r[k] for k in NUMBERS],
                         r["state"], r["error"] or "", r["run_dir"]])
    return out.getvalue()


def plot_comparison(result: Dict[str, Any], out: Path) -> Path:
    from pipeline.observe.plots import plot_overlay

    return plot_overlay([(Path(r["run_dir"]), run_label(r, with_keys=False), r["state"]) for r in result["runs"]],
                        Path(out), title=f"{Path(os.path.commonpath([r['run_dir'] for r in result['runs']])).name}: "
                                         f"{len(result['runs'])} run(s)",
                        legend_title="run: " + ", ".join(result["columns"]) if result["columns"] else "")


def report_sweep(sweep_dir: Path, stream=None) -> None:
    """End of ``tokenflow train -m``: the comparison table and SWEEP_DIR/compare.png (a detached
    sweep: the listing of its points). A failure here is reported, never raised: the runs are done."""
    stream = stream or sys.stdout
    try:
        points = sweep_points(sweep_dir)
        if not points:
            return
        if any(run_config(p).get("run.detach") for p in points):
            print(format_sweep_status(sweep_status(sweep_dir)), file=stream)
            print(f"tokenflow: follow the sweep with `tokenflow status {sweep_dir}`, compare its points with "
                  f"`tokenflow compare {sweep_dir} [--plot out.png]`", file=stream, flush=True)
            return
        result = compare_runs(points)
        png = plot_comparison(result, Path(sweep_dir) / PLOT_FILE)
        print(f"\n{format_table(result)}\ntokenflow: sweep done; curves of all points in {png}", file=stream,
              flush=True)
    except Exception as exc:  # noqa: BLE001 - the summary must not hide the sweep's own outcome
        print(f"tokenflow: could not compare the points of {sweep_dir}: {exc!r}", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenflow compare", description="runs side by side: differing config "
                                     "keys, held-out accuracy, reward, throughput, staleness, state")
    parser.add_argument("paths", nargs="+", help="a sweep directory, run directories, or glob patterns")
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print one JSON object")
    fmt.add_argument("--csv", action="store_true", help="print CSV, one row per run")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="overlay accuracy and reward curves")
    parser.add_argument("--last", type=int, default=LAST_STEPS, metavar="N",
                        help=f"mean reward over the last N steps (default {LAST_STEPS})")
    args = parser.parse_args(argv)
    if args.last < 1:
        parser.error("--last must be at least 1")
    try:
        result = compare_runs(find_runs(args.paths), last_steps=args.last)
    except ValueError as exc:
        print(f"tokenflow compare: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        plot_comparison(result, args.plot)
    if args.json:
        print(json.dumps(result))
    elif args.csv:
        sys.stdout.write(to_csv(result))
    else:
        print(format_table(result))
        if args.plot:
            print(f"curves in {args.plot}")
    return 0
