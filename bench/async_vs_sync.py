"""Asynchronous against synchronous training on the same work: speed-up S against its bound B.

Two `tokenflow train` runs (subprocesses, one after the other, each its own run directory under a
temporary folder) do the same work: the same prompt file, the same seed (so the same prompt stream),
the same number of optimizer steps (>= 30 in full mode), the same model and warm-start, the same
CPU core plan (``cluster.cpu_plan=auto``: generator on core 0, trainer + orchestrator on core 1).
They differ only in ``algo``: ``algo=sync`` (max_async = 0: generation of step k starts once the
weights of step k are loaded) and the default ``algo=grpo`` (max_async = 1). Evaluation is off and
checkpoints are taken only at the end, so the runs do nothing but generate and train.

Workload (long-tailed completion lengths). The prompts are a JSON Lines file written here
(``task=jsonl``): "sort <digits>" with the sorted digits as answer; the reference completion is
``\\boxed{<sorted digits>}``, one token per digit, so a completion's length follows the digit count.
Digit counts are drawn as ``clip(round(3 * X), 3, 48)`` with X ~ Pareto(alpha 1.5): median 5
digits, 90th percentile 14, 6 % more than 18, ~2 % the full 48 (completions of ~8 to ~53 tokens,
plus whatever the sampled policy rambles, capped by generator.max_tokens = 64; measured on the
consumed samples: median ~9-10 tokens, 90th percentile 15-24, max 64). With 8 prompts per
step, a synchronous step waits for the longest group while the engine decodes a nearly empty batch;
the asynchronous run keeps the next step's groups decoding meanwhile. The measured completion-length
percentiles are reported from the rollout log. The warm-start for this file is built (cached) before
either run is timed.

Definitions (all from the runs' own records: RUN/metrics/ and the rollout log):
- process time: wall time of the `tokenflow train` subprocess, start to exit (includes model load,
  engine start, megatron initialisation, the final checkpoint and shutdown);
- steady-state time T: from the first moment either side works on step 0 (the earlier of the trainer
  starting to wait for batch 0, i.e. the train_step record's time minus wait_s + step_s + sync_s, and
  the first rollout's t_start) to the last train_step record (after its weight push). It excludes the
  one-off start-up and includes the pipeline fill; S = T_sync / T_async uses it;
- ΣT_train: sum over steps of the trainer's busy time, step_s (forward, backward, optimizer) + sync_s
  (weight gather and broadcast), from the synchronous run's train_step records;
- ΣT_gen: sum over steps k of the generator busy time of step k in the synchronous run: the length
  of the union of the [t_start, t_end] intervals of the samples step k consumed (from the rollout
  log). In the synchronous run the steps' generation phases do not overlap, so this is the time the
  generator needs for the run's rollouts when nothing else competes with them;
- pipeline fill: min(mean per-step generation time, mean per-step training time) of the synchronous
  run: a two-stage pipeline of N steps with per-step times a and b ends after N * max(a, b) +
  min(a, b), so B = T_sync / (max(ΣT_gen, ΣT_train) + fill) is the best speed-up overlap can give;
- trainer idle fraction: the trainer's own last ``trainer_idle_frac`` (1 - busy / time since its
  loop started), for both runs;
- S_per_token: S scaled by the ratio of completion tokens the two runs trained on (async runs
  drop groups older than max_staleness, which are more often the long ones, so equal steps need
  not be equal tokens);
- wasted work: groups admitted and groups dropped as stale (orchestrator counters) per run; the
  time spent generating dropped groups is in T but not in ΣT_gen (which counts consumed samples).
Target: S >= 0.8 * B.

    python bench/async_vs_sync.py --quick     # 2 steps each, both runs at once: checks the harness only
    python bench/async_vs_sync.py --smoke     # 1 step each of 2 groups, <= 16 tokens, untrained model (no
                                              # warm-start), no core plan, both at once
    python bench/async_vs_sync.py             # 32 steps each, one after the other (several minutes)

--quick cannot be faster than one `tokenflow train` start-up (model load, vLLM engine start,
megatron initialisation): about 45 s on an idle 2-core machine, over two minutes on a loaded one.
The first invocation also builds the warm-start of the prompt file (about 1-5 minutes, cached).

Prints per-run figures, then one JSON line. The machine may be shared: other processes on the same
two cores change both runs' times; repeat and compare before trusting a single figure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT_SEED = 7  # the prompt file is the same on every invocation, so its warm-start is cached once
MAX_DIGITS = 48


def write_long_tail_prompts(path: Path, rows: int = 3000) -> dict:
    """The long-tailed sort prompt file (see the module docstring); returns its digit-count stats."""
    rng = random.Random(PROMPT_SEED)
    counts = []
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            n = min(MAX_DIGITS, max(3, round(3 * rng.paretovariate(1.5))))
            digits = "".join(str(rng.randrange(10)) for _ in range(n))
            f.write(json.dumps({"prompt": f"sort {digits}", "answer": "".join(sorted(digits))}) + "\n")
            counts.append(n)
    counts.sort()
    return {"rows": rows, "digits_p50": counts[rows // 2], "digits_p90": counts[rows * 9 // 10],
            "digits_max": counts[-1], "share_over_18_digits": sum(c > 18 for c in counts) / rows}


def common_overrides(prompts: Path, steps: int) -> list[str]:
    return [f"run.steps={steps}", "run.eval_every=0", "run.checkpoint_every=100000", "run.progress=false",
            "logger=[]", "task=jsonl", f"task.path={prompts}", "task.eval_size=20",
            "generator.max_tokens=64", "cluster.cpu_plan=auto"]


def prebuild_warm_start(prompts: Path, scratch: Path) -> str:
    """Build (or find cached) the run's starting checkpoint exactly as the trainer role does."""
    from pipeline.config import TokenflowConfig
    from pipeline.roles.trainer import prepare_model
    from pipeline.tasks import TaskConfig

    cfg = TokenflowConfig(task=TaskConfig(name="jsonl", path=str(prompts), eval_size=20))
    scratch.mkdir(parents=True, exist_ok=True)
    return str(prepare_model(scratch, cfg))


def start_run(name: str, root: Path, overrides: list[str]) -> tuple[subprocess.Popen, float]:
    tokenflow = Path(sys.executable).with_name("tokenflow")
    cmd = [str(tokenflow), "train", f"run.name={name}", f"hydra.run.dir={root / name}", *overrides]
    out = open(root / f"{name}.out", "w")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=root,
                            start_new_session=True), time.monotonic()


def stop_run(proc: subprocess.Popen) -> None:
    """Stop a run we started: SIGINT makes its launcher cancel the roles (each leads its own group)."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def wait_run(proc: subprocess.Popen, started: float, name: str, root: Path, timeout_s: float) -> float:
    """Wall seconds of the run; raises with the run's output tail when it fails or times out."""
    try:
        rc = proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        stop_run(proc)
        rc = None
    wall = time.monotonic() - started
    if rc != 0:
        tail = (root / f"{name}.out").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"run {name} {'timed out' if rc is None else f'exited with {rc}'} after "
                           f"{wall:.0f}s; output tail:\n{tail}")
    return wall


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a set of [start, end] intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def analyse(run_dir: Path) -> dict:
    """Steady-state window, trainer and generator busy times and length stats of one run."""
    import numpy as np

    from pipeline.rollout_log.reader import RolloutLog
    from pipeline.metrics import read_metrics
    from pipeline.run_files import ROLLOUTS_DIR

    steps = sorted(read_metrics(run_dir, "train_step"), key=lambda r: r["step"])
    if not steps:
        raise RuntimeError(f"{run_dir} logged no train_step records")
    first = steps[0]
    trainer_start = first["t"] - (first["wait_s"] + first["step_s"] + first["sync_s"])
    train_s = [r["step_s"] + r["sync_s"] for r in steps]
    with RolloutLog.open(run_dir / ROLLOUTS_DIR) as log:
        t0s, t1s = log.column("samples/t_start"), log.column("samples/t_end")
        lens, prompt_ids = log.column("samples/completion_len"), log.column("samples/prompt_id")
        index = {int(r): i for i, r in enumerate(log.rows())}
        step_rows = log.step_rows()
    consumed = [index[int(r)] for k in sorted(step_rows) for r in step_rows[k]]
    gen_s = [union_length([(t0s[index[int(r)]], t1s[index[int(r)]]) for r in step_rows[k]])
             for k in sorted(step_rows)]
    start = min(trainer_start, float(t0s.min()))
    used = lens[consumed]
    gen = list(read_metrics(run_dir, "generator"))
    orch = list(read_metrics(run_dir, "orchestrator"))
    last = orch[-1] if orch else {}
    return {
        "steps": len(steps), "steady_s": steps[-1]["t"] - start,
        "sum_train_s": float(sum(train_s)), "sum_gen_per_step_s": float(sum(gen_s)),
        "gen_busy_union_s": union_length([(t0s[i], t1s[i]) for i in consumed]),
        "mean_train_step_s": float(np.mean(train_s)), "mean_gen_step_s": float(np.mean(gen_s)),
        "trainer_idle_frac": steps[-1]["trainer_idle_frac"],
        "generator_idle_frac": gen[-1]["idle_frac"] if gen else None,
        "generator_stall_s": gen[-1]["stall_s"] if gen else None,
        "staleness_mean": float(np.mean([r["staleness_mean"] for r in steps])),
        "reward_mean": float(np.mean([r["reward_mean"] for r in steps])),
        "completion_len_p50": float(np.percentile(used, 50)),
        "completion_len_p90": float(np.percentile(used, 90)),
        "completion_len_max": int(used.max()), "completion_len_mean": float(used.mean()),
        "completion_tokens": int(used.sum()),
        "groups_admitted": last.get("admitted"),
        "groups_dropped_stale": (last.get("count_dropped_stale", 0)
                                 + last.get("count_dropped_stale_buffered", 0)),
        "samples": int(len(consumed)), "prompt_ids": sorted({int(p) for p in prompt_ids[consumed]}),
    }


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="2 steps each, both runs at once (< 1 min with "
                      "a cached warm-start; checks the harness, its times mean nothing)")
    size.add_argument("--smoke", action="store_true", help="as --quick with 1 step each of 2 groups of <= 16 "
                      "tokens and no warm-start: the report's keys, not its figures")
    ap.add_argument("--steps", type=int, default=32, help="optimizer steps per run (full mode)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds each run may take")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args()
    steps = 1 if args.smoke else 2 if args.quick else args.steps
    root = Path(tempfile.mkdtemp(prefix="tokenflow-async-vs-sync-"))
    try:
        prompts = root / "long_tail_sort.jsonl"
        prompt_stats = write_long_tail_prompts(prompts)
        t = time.monotonic()
        base = common_overrides(prompts, steps)
        if args.smoke:  # the untrained tiny model: no warm-start to build (minutes in a fresh cache); no core
            # plan, which would put both runs' generators (two processes importing vLLM each) on core 0; 2
            # groups of 16 tokens at most per step (the workload's tail cut: its figures mean nothing)
            base += ["model.warmstart_steps=0", "cluster.cpu_plan=none", "orchestrator.groups_per_step=2",
                     "generator.max_tokens=16"]
        else:
            model = prebuild_warm_start(prompts, root / "prebuild")
            print(f"prompts {prompt_stats}; warm-start {model} ready in {time.monotonic() - t:.0f}s", flush=True)
        t = time.monotonic()
        plan = {"sync": ["algo=sync"], "async": []}
        walls: dict[str, float] = {}
        started: dict[str, tuple[subprocess.Popen, float]] = {}
        try:
            if args.quick or args.smoke:  # both at once: they share the core plan, so only the harness is checked
                started = {name: start_run(name, root, base + extra) for name, extra in plan.items()}
                ends: dict[str, float] = {}
                while len(ends) < len(started) and time.monotonic() - t < args.timeout:
                    ends.update({n: time.monotonic() for n, (p, _) in started.items()
                                 if n not in ends and p.poll() is not None})
                    time.sleep(0.2)
                for name, (proc, t0) in started.items():
                    wait_run(proc, t0, name, root, args.timeout)  # raises if it failed
                    walls[name] = ends[name] - t0
            else:
                for name, extra in plan.items():
                    started[name] = start_run(name, root, base + extra)
                    walls[name] = wait_run(*started[name], name, root, args.timeout)
                    print(f"{name}: process {walls[name]:.1f}s", flush=True)
        finally:
            for proc, _ in started.values():
                stop_run(proc)
        runs = {name: analyse(root / name) for name in plan}
        shared = set(runs["sync"].pop("prompt_ids")) & set(runs["async"]["prompt_ids"])
        prompts_used = len(runs["async"].pop("prompt_ids"))
        for name, r in runs.items():
            print(f"{name:>5}: steady {r['steady_s']:.1f}s (process {walls[name]:.1f}s), trainer busy "
                  f"{r['sum_train_s']:.1f}s idle {r['trainer_idle_frac']:.2f}, generation per step "
                  f"{r['mean_gen_step_s']:.2f}s, completion len p50/p90/max {r['completion_len_p50']:.0f}/"
                  f"{r['completion_len_p90']:.0f}/{r['completion_len_max']}, groups admitted "
                  f"{r['groups_admitted']} dropped stale {r['groups_dropped_stale']}", flush=True)
        s, a = runs["sync"], runs["async"]
        fill = min(s["mean_gen_step_s"], s["mean_train_step_s"])
        bound = s["steady_s"] / (max(s["sum_gen_per_step_s"], s["sum_train_s"]) + fill)
        speedup = s["steady_s"] / a["steady_s"]
        return {
            "bench": "async_vs_sync", "quick": args.quick, "steps": steps, "workload": prompt_stats,
            "T_sync_s": s["steady_s"], "T_async_s": a["steady_s"],
            "T_sync_process_s": walls["sync"], "T_async_process_s": walls["async"],
            "S": speedup, "S_process": walls["sync"] / walls["async"],
            "S_per_token": speedup * a["completion_tokens"] / s["completion_tokens"],
            "sum_T_gen_s": s["sum_gen_per_step_s"], "sum_T_train_s": s["sum_train_s"], "fill_s": fill,
            "B": bound, "S_over_B": speedup / bound, "target": "S >= 0.8 * B", "met": speedup >= 0.8 * bound,
            "trainer_idle_frac_sync": s["trainer_idle_frac"],
            "trainer_idle_frac_async": a["trainer_idle_frac"],
            "shared_prompt_frac": len(shared) / max(1, prompts_used),
            "machine_load_1min": os.getloadavg()[0], "runs": runs,
        }
    finally:
        if args.keep:
            print(f"run directories kept in {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    with no_process_left():
        print(json.dumps(main()))
