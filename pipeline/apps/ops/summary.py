"""One run summed up from its directory: the numbers `tokenflow compare` tabulates and TensorBoard's
HParams view gets, and the run's state (running, pending, finished, failed with its error).

Everything is read from files the run writes (`RUN/metrics/`, `RUN/launch/launches.jsonl`,
`RUN/results/`, `RUN/COMPLETE`; Slurm states through `pipeline.apps.ops.run_status`), so a run still
going is summed up as it stands, and a killed one as far as it got.

Invariants:
- a step or evaluation recorded twice (a resumed run redoes the steps after its last checkpoint)
  counts once, with its latest record;
- counters of the orchestrator restart at zero with each orchestrator start; `drops` adds the
  last value before every restart to the final one, so a resumed run's drops are all counted;
- wall time is the sum over launches of (latest record of that launch - launch time); a resume a day
  later does not add the day. A run still going counts its last launch up to now.

- the train-inference mismatch (`mismatch`: mean |trainer - generator| logprob of the tokens the
  current weights generated, measured every run.mismatch_every steps) is reported at the first step
  that measured it (step 0 unless resumed past it: the generator's and trainer's precision and
  kernels alone, before any update) and at the last one.
- throughput and idleness are those of the training loop: tokens/s = trained tokens / loop time
  and trainer idle = time waiting for batches / loop time, where loop time is the sum of the steps'
  wait_s + step_s + sync_s; the first step is left out when there are later ones (its wait holds
  the generators' start-up and the first evaluation, which no setting of the run changes).

Worked example: steps 0..2 with (tokens, wait_s, step_s, sync_s) = (250, 90, 1, 0), (240, 1, 1, 0),
(260, 3, 1, 0): tokens/s = 500 / 6 = 83.3, trainer idle = 4 / 6 = 67 %. A run launched at t=100 that wrote records until t=160, was resumed at t=1000 and
wrote until t=1030 has wall_s = 60 + 30 = 90. Its orchestrator counted dropped_stale 2, 5 before
the resume and 1, 3 after it: drops = 5 + 3 = 8.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from pipeline.metrics import latest_by_step, mismatch_points, read_metrics

#: `reward_last` is the mean batch reward of this many last steps.
LAST_STEPS = 5
#: Orchestrator counters that are groups dropped (stale on arrival, stale in the buffer, ahead of the trainer).
DROP_PREFIX = "count_dropped_"


def _restart_safe_totals(records: List[Dict[str, Any]], prefix: str) -> Dict[str, int]:
    """Per counter (name without `prefix`): its total over orchestrator restarts (see the module doc)."""
    base: Dict[str, int] = {}
    last: Dict[str, int] = {}
    for rec in records:
        for key, value in rec.items():
            if key.startswith(prefix) and isinstance(value, int):
                if value < last.get(key, 0):
                    base[key] = base.get(key, 0) + last[key]
                last[key] = value
    return {k[len(prefix):]: base.get(k, 0) + v for k, v in last.items()}


def launch_times(run_dir: Path) -> List[float]:
    path = Path(run_dir) / "launch" / "launches.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["time"] for line in path.read_text().splitlines() if line.strip()]


def wall_seconds(starts: List[float], times: List[float], running: bool) -> Optional[float]:
    """Sum over launches of (latest record of the launch - launch time); see the module doc."""
    if not starts:
        return (max(times) - min(times)) if times else None
    total = 0.0
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else math.inf
        if running and i == len(starts) - 1:
            total += time.time() - start
        else:
            total += max((t for t in times if start <= t < end), default=start) - start
    return total


def metric_summary(run_dir: Path, running: bool = False, last_steps: int = LAST_STEPS) -> Dict[str, Any]:
    """The run's numbers from its metrics stream (None where it has none yet)."""
    run_dir = Path(run_dir)
    records = list(read_metrics(run_dir))
    steps = latest_by_step([r for r in records if r.get("kind") == "train_step"])
    evals = latest_by_step([r for r in records if r.get("kind") == "eval"])
    final = evals[-1] if evals else None
    best = max(evals, key=lambda e: (e.get("accuracy") or 0.0, -e["step"])) if evals else None
    rewards = [s["reward_mean"] for s in steps[-last_steps:] if s.get("reward_mean") is not None]
    weighted = [(s["staleness_mean"], s.get("samples") or 1) for s in steps if s.get("staleness_mean") is not None]
    timed = [s for s in (steps[1:] if len(steps) > 1 else steps)
             if all(isinstance(s.get(k), (int, float)) for k in ("tokens", "wait_s", "step_s", "sync_s"))]
    loop_s = sum(s["wait_s"] + s["step_s"] + s["sync_s"] for s in timed)
    orchestrator = [r for r in records if r.get("kind") == "orchestrator"]
    drops = {k: v for k, v in _restart_safe_totals(orchestrator, DROP_PREFIX).items() if v}
    return {
        "final_accuracy": final.get("accuracy") if final else None,
        "final_pass_at_k": final.get("pass_at_k") if final else None,
        "eval_k": final.get("k") if final else None,
        "final_by_set": eval_sets(final) if final else {},
        "final_accuracy_step": final["step"] if final else None,
        "best_accuracy": best.get("accuracy") if best else None,
        "best_accuracy_step": best["step"] if best else None,
        "reward_last": sum(rewards) / len(rewards) if rewards else None,
        "reward_last_steps": len(rewards),
        "steps_done": steps[-1]["step"] + 1 if steps else 0,
        "tokens_per_s": sum(s["tokens"] for s in timed) / loop_s if loop_s > 0 else None,
        "trainer_idle_frac": sum(s["wait_s"] for s in timed) / loop_s if loop_s > 0 else None,
        "staleness_mean": (sum(v * n for v, n in weighted) / sum(n for _, n in weighted)) if weighted else None,
        "drops": sum(drops.values()) if orchestrator else None,
        "drops_by_reason": drops,
        "wall_s": wall_seconds(launch_times(run_dir), [r["t"] for r in records if "t" in r], running),
        **mismatch_points(steps),
    }


def eval_sets(record: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """{held-out set or "source/<data_source>": {accuracy, pass_at_k, n}} of an ``eval`` record
    (pipeline.orchestrator.evaluation: keys ``<metric>/<label>``)."""
    out: Dict[str, Dict[str, float]] = {}
    for key, value in record.items():
        metric, _, label = key.partition("/")
        if label and metric in ("accuracy", "pass_at_k", "n", "sampled_accuracy"):
            out.setdefault(label, {})[metric] = value
    return out


def _trainer_result(run_dir: Path) -> Optional[Dict[str, Any]]:
    from pipeline.launch.task import result_path

    path = result_path(run_dir, "trainer", 0)
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def run_state(run_dir: Path) -> Tuple[str, Optional[str], Dict[str, Any]]:
    """(state, error, status) of a run: "running", "pending" (Slurm, every component waiting),
    "finished" or "failed"; error says why a failed run failed; status is `run_status`'s dict ({}
    for a run never launched)."""
    from pipeline.apps.ops import LAUNCHES, STOPPED_STATES, run_status

    run_dir = Path(run_dir)
    if not (run_dir / LAUNCHES).exists():
        return "failed", "never launched (no launch/launches.jsonl; see the train command's output)", {}
    status = run_status(run_dir)
    states = [c["state"] for c in status["components"]]
    if any(s not in STOPPED_STATES for s in states):
        return ("pending" if all(s == "PENDING" for s in states) else "running"), None, status
    result = _trainer_result(run_dir)
    steps = status.get("steps")
    done = status["steps_done"]
    if status["complete"] or (result and result.get("ok") and not result.get("stopped")
                              and steps is not None and done >= steps):
        return "finished", None, status
    if status["last_error"]:
        return "failed", status["last_error"], status
    bad = [f"{c['role']} {c['state']}" for c in status["components"] if c["state"] not in ("COMPLETED", "EXITED")]
    return "failed", f"stopped at step {done}/{steps}" + (f" ({', '.join(bad)})" if bad else ""), status


def run_hparams(run_dir: Path) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(hparams, summary numbers) of a run's TensorBoard HParams session: its command-line
    overrides with the values it resolved, plus ``task.name`` and ``model.name``; `metric_summary`."""
    from pipeline.apps.ops.sweep import command_overrides, run_config

    config = run_config(run_dir)
    params = {k: config[k] for k in ("task.name", "model.name") if k in config}
    params.update(command_overrides(run_dir))
    return params, metric_summary(run_dir)
