"""Reward curves of the importance-correction presets side by side: one short demo run per preset.

Each preset (``trainer.loss.correction``, docs/corrections.md) trains the built-in demo (tiny MoE,
sort task, asynchronous GRPO) for ``--steps`` steps from the same seed, one run after the other in
``--out``/<preset>, evaluated at the first and the last step; the figure overlays their batch
reward and held-out accuracy
(`pipeline.observe.plots.plot_overlay`). Printed: per preset the mean batch reward of the first and
last third of the steps, final accuracy, and the per-step means of the IS weight and of the
truncated and masked token fractions; the last line is one JSON object.

    python scripts/preset_curves.py --out runs/presets                 # 7 presets x 10 steps
    python scripts/preset_curves.py --presets token_tis icepop --steps 8 -- generator.dtype=bfloat16

Short runs on a shared CPU differ by sampling noise as much as by preset: read the figure as
"each preset trains, here is how its weights behave", not as a ranking.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

PRESETS = ("none", "token_tis", "seq_tis", "token_mis", "seq_mis", "geo_mask", "icepop")


def run_preset(out: Path, preset: str, steps: int, extra: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline.cli", "train", f"run.name={preset}", f"hydra.run.dir={out / preset}",
           f"run.steps={steps}", f"run.eval_every={steps}", "run.progress=false",
           "logger=[]", "run.mismatch_every=1", f"trainer.loss.correction={preset}", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def summary(run_dir: Path) -> dict:
    from pipeline.metrics import read_metrics

    steps = list(read_metrics(run_dir, "train_step"))
    evals = [e for e in read_metrics(run_dir, "eval") if e.get("accuracy") is not None]
    reward = np.array([s["reward_mean"] for s in steps])
    third = max(1, len(reward) // 3)

    def mean(key):
        vals = [s[key] for s in steps if s.get(key) is not None]
        return float(np.mean(vals)) if vals else None
    return {"steps": len(steps), "reward_first_third": float(reward[:third].mean()),
            "reward_last_third": float(reward[-third:].mean()),
            "accuracy_first": evals[0]["accuracy"] if evals else None,
            "accuracy_last": evals[-1]["accuracy"] if evals else None,
            "is_weight_mean": mean("is_weight_mean"), "is_weight_max": mean("is_weight_max"),
            "tis_clip_fraction": mean("tis_clip_fraction"), "is_mask_fraction": mean("is_mask_fraction"),
            "mismatch": mean("mismatch")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/presets"))
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--replot", action="store_true",
                    help="train nothing: plot and summarise the presets' finished runs already in --out")
    ap.add_argument("overrides", nargs="*", help="more `tokenflow train` overrides, after --")
    args = ap.parse_args()
    from pipeline.apps.train import COMPLETE
    from pipeline.observe.plots import plot_overlay

    args.out.mkdir(parents=True, exist_ok=True)
    results, runs = {}, []
    for preset in args.presets:
        if args.replot:
            if not (args.out / preset / COMPLETE).exists():
                continue
            state = "finished"
        else:
            done = run_preset(args.out, preset, args.steps, args.overrides)
            state = "finished" if done.returncode == 0 else "failed"
            if state == "failed":
                print(f"{preset}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
        runs.append((args.out / preset, preset, state))
        results[preset] = {"state": state, **(summary(args.out / preset) if state == "finished" else {})}
    steps = max((r.get("steps", 0) for r in results.values()), default=0)
    figure = plot_overlay(runs, args.out / "presets.png", title=f"correction presets, {steps} steps each",
                          legend_title="trainer.loss.correction")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"{'preset':<10} {'reward 1st/3':>12} {'last 1/3':>9} {'acc first':>9} {'last':>6} "
          f"{'IS mean':>8} {'IS max':>7} {'trunc':>6} {'masked':>7}")
    for preset, r in results.items():
        if r["state"] != "finished":
            print(f"{preset:<10} failed")
            continue
        print(f"{preset:<10} {r['reward_first_third']:>12.3f} {r['reward_last_third']:>9.3f} "
              f"{fmt(r['accuracy_first'], '>9.2f')} {fmt(r['accuracy_last'], '>6.2f')} "
              f"{fmt(r['is_weight_mean'], '>8.3f')} {fmt(r['is_weight_max'], '>7.2f')} "
              f"{fmt(r['tis_clip_fraction'], '>6.3f')} {fmt(r['is_mask_fraction'], '>7.3f')}")
    print(json.dumps({"figure": str(figure), "steps": steps, "presets": results}))


if __name__ == "__main__":
    main()
