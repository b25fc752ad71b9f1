"""Figures (PNG): one run's reward, held-out accuracy (greedy; pass@k with ``eval.samples``; each named
held-out set when there are several), staleness and train-inference mismatch (log scale, its first
measured value, step 0's, written on the panel) over optimizer steps (`plot_run`,
the end-of-run figure); several runs' accuracy and reward curves overlaid (`plot_overlay`, for
`tokenflow compare` and the end of a sweep)."""
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
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    ax = axes[0]
    ax.plot([s["step"] for s in steps], [s.get("reward_mean") for s in steps], marker=".", lw=1)
    ax.set(title="mean reward of the step's batch", xlabel="optimizer step", ylabel="reward")
    ax = axes[1]
    ax.plot([e["step"] for e in evals], [100 * e["accuracy"] for e in evals], marker="o", color="C2",
            label="greedy (pass@1)")
    with_k = [e for e in evals if e.get("pass_at_k") is not None]
    if with_k:
        ax.plot([e["step"] for e in with_k], [100 * e["pass_at_k"] for e in with_k], marker="s", color="C4",
                ls="--", label=f"pass@{with_k[-1]['k']}")
    sets = sorted({k.split("/", 1)[1] for e in evals for k in e if k.startswith("accuracy/")
                   and not k.startswith("accuracy/source/")})
    for i, name in enumerate(sets if len(sets) > 1 else []):
        ax.plot([e["step"] for e in evals if f"accuracy/{name}" in e],
                [100 * e[f"accuracy/{name}"] for e in evals if f"accuracy/{name}" in e], lw=1, ls=":",
                color=f"C{5 + i % 5}", label=f"greedy {name}")
    ax.set(title="held-out accuracy", xlabel="optimizer step", ylabel="% correct", ylim=(0, 100))
    if with_k or len(sets) > 1:
        ax.legend(loc="lower right", fontsize="small")
    ax = axes[2]
    ax.plot([s["step"] for s in steps], [s.get("staleness_mean") for s in steps], label="mean", color="C1")
    ax.plot([s["step"] for s in steps], [s.get("staleness_max") for s in steps], label="max",
            color="C3", ls="--")
    ax.set(title="staleness (trainer - token version)", xlabel="optimizer step", ylabel="versions")
    ax.legend(loc="upper left")
    ax = axes[3]
    measured = [s for s in steps if isinstance(s.get("mismatch"), (int, float))]
    ax.plot([s["step"] for s in measured], [max(s["mismatch"], 1e-12) for s in measured], marker=".", color="C4")
    ax.set(title="train-inference mismatch", xlabel="optimizer step", ylabel="mean |train - generator| logprob",
           yscale="log")
    if measured:
        ax.annotate(f"step {measured[0]['step']}: {measured[0]['mismatch']:.1e}", (0.02, 0.92),
                    xycoords="axes fraction", fontsize="small")
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_overlay(runs: list[tuple[Path, str, str]], out: Path, title: str = "", legend_title: str = "") -> Path:
    """Held-out accuracy and batch reward of several runs on shared axes, one colour per run.

    `runs` holds (run directory, legend label, state); a failed run's curves are dashed and its
    label says so, a running one is labelled "running" (its curves end where it stands). The legend
    sits below the axes (titled `legend_title`, e.g. the names of the keys the labels give values
    of), one column when labels are long; the figure grows with it, the axes keep their size.
    """
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    labels = [label if state == "finished" else f"{label} ({state})" for _, label, state in runs]
    ncol = 1 if max(map(len, labels), default=0) > 40 else min(len(runs), 3) or 1
    legend_title = "\n".join(textwrap.wrap(legend_title, 150))
    legend_lines = -(-len(runs) // ncol) + (legend_title.count("\n") + 1 if legend_title else 0)
    legend_in = 0.25 + 0.2 * legend_lines
    fig, (acc_ax, reward_ax) = plt.subplots(1, 2, figsize=(13, 4.2 + legend_in))
    colours = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20")
    for i, ((run_dir, _, state), label) in enumerate(zip(runs, labels)):
        # Earlier runs drawn wider, markers of different shapes: runs whose curves coincide stay visible.
        style = {"color": colours(i % colours.N), "ls": "--" if state == "failed" else "-", "label": label,
                 "lw": 1.2 + 2.0 * (len(runs) - 1 - i) / max(1, len(runs) - 1), "marker": "os^Dv<>ph*"[i % 10]}
        evals = {e["step"]: e for e in read_metrics(run_dir, "eval") if e.get("accuracy") is not None}
        steps = {s["step"]: s for s in read_metrics(run_dir, "train_step") if s.get("reward_mean") is not None}
        acc_ax.plot(sorted(evals), [100 * evals[k]["accuracy"] for k in sorted(evals)], ms=5, **style)
        with_k = sorted(k for k in evals if evals[k].get("pass_at_k") is not None)
        if with_k:  # pass@k: the same colour, dotted, no legend entry of its own
            acc_ax.plot(with_k, [100 * evals[k]["pass_at_k"] for k in with_k], color=style["color"], ls=":",
                        lw=1.2, marker=style["marker"], ms=3)
        reward_ax.plot(sorted(steps), [steps[k]["reward_mean"] for k in sorted(steps)], ms=3, **style)
    acc_ax.set(title="held-out greedy accuracy (dotted: pass@k)", xlabel="optimizer step", ylabel="% correct", ylim=(0, 100))
    reward_ax.set(title="mean reward of the step's batch", xlabel="optimizer step", ylabel="reward")
    for ax in (acc_ax, reward_ax):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, _ = acc_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize="small", frameon=False,
               title=legend_title or None, title_fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, legend_in / (4.2 + legend_in), 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
