"""The end-of-run figure: reward, held-out accuracy and staleness over optimizer steps (PNG)."""
from __future__ import annotations

from pathlib import Path

from pipeline.metrics import read_metrics
from pipeline.run_files import PLOT_FILE


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    out = out or run_dir / PLOT_FILE
    steps = list(read_metrics(run_dir, "train_step"))
    evals = list(read_metrics(run_dir, "eval"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    ax = axes[0]
    ax.plot([s["step"] for s in steps], [s.get("reward_mean") for s in steps], marker=".", lw=1)
    ax.set(title="mean reward of the step's batch", xlabel="optimizer step", ylabel="reward")
    ax = axes[1]
    ax.plot([e["step"] for e in evals], [100 * e["accuracy"] for e in evals], marker="o", color="C2")
    ax.set(title="held-out greedy accuracy", xlabel="optimizer step", ylabel="% correct", ylim=(0, 100))
    ax = axes[2]
    ax.plot([s["step"] for s in steps], [s.get("staleness_mean") for s in steps], label="mean", color="C1")
    ax.plot([s["step"] for s in steps], [s.get("staleness_max") for s in steps], label="max",
            color="C3", ls="--")
    ax.set(title="staleness (trainer - token version)", xlabel="optimizer step", ylabel="versions")
    ax.legend(loc="upper left")
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
