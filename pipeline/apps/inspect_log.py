"""`tokenflow inspect PATH [--plot OUT.png] [--json]`: summarise a run's rollout log.

PATH is a run directory, its ``rollouts/`` directory, or one segment file (the whole log is read,
and a note says so). It may run on any node while the run goes on: it reads every sealed segment
plus the journal's valid entries, and says (``journal``) how far behind the writer that may be. The summary holds counts (samples, groups by outcome,
steps, tokens), the mean reward by policy version, a staleness histogram, prompt and completion
length statistics and finish reasons. ``--json`` prints the summary as ONE JSON object, the only
line on stdout (NaN becomes null); ``--plot`` writes a PNG of reward by version, staleness and
lengths. Bad paths or files exit with code 2 and a message naming the problem (never a traceback).
Damage (`docs/rollout-log.md`, "Damage") is named on stderr and in ``damage``, and exits 1; reads
check the blocks they touch, ``--verify`` every block of every segment. A log of multi-turn
episodes (record schema with ``model_mask``) also gets ``episodes``: turns, tool calls, masked
environment tokens, and the last ``--episodes N`` episodes turn by turn with their versions and
(when the run's model is found) text (`pipeline.apps.inspect_episodes`).

Definitions (worked example): a sample's *version* is its oldest token's policy version. Its
*staleness* is the trainer version of the step that consumed it minus its version; a sample no
step consumed is measured against the *reference version*: the newest version the log knows of,
max(trainer version of the latest step, highest sample version) -- the trainer is at least there.
A sample of version 3 consumed by a step at trainer version 5 has staleness 2; with the latest
step at trainer version 6 and samples up to version 7 in the log, an unconsumed sample of
version 4 has staleness 7 - 4 = 3.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np

from pipeline.rollout_log.format import CorruptSegmentError, GroupOutcome, LogError
from pipeline.rollout_log.reader import RolloutLog
from pipeline.protocol.record import FINISH_REASONS

#: Logs with more samples than this show progress on stderr even when it is not a terminal.
LARGE_LOG_SAMPLES = 1_000_000
_LENGTH_BINS = 30


def _progress_printer(enabled: bool):
    """Progress lines on stderr (one line rewritten in place on a terminal)."""
    tty = sys.stderr.isatty()

    def show(msg: str, last: bool = False) -> None:
        if enabled:
            end = "\n" if (last or not tty) else ""
            sys.stderr.write(("\r" if tty else "") + msg.ljust(60 if tty else 0) + end)
            sys.stderr.flush()
    return show


def _length_stats(x: np.ndarray) -> dict:
    if not len(x):
        return {"min": None, "mean": None, "p50": None, "p90": None, "max": None}
    return {"min": int(x.min()), "mean": float(x.mean()), "p50": float(np.percentile(x, 50)),
            "p90": float(np.percentile(x, 90)), "max": int(x.max())}


def _histogram(values: np.ndarray) -> dict[str, int]:
    keys, counts = np.unique(values, return_counts=True)
    return {str(int(k)): int(c) for k, c in zip(keys, counts)}


def scorer_summary(log: RolloutLog) -> dict:
    """What scorer roles filled (`docs/scorers.md`), where the schema records it: per-token
    (process) rewards -- how many tokens carry a step reward and their mean; the teacher --
    samples by ``teacher_version`` and the reverse KL of the sampling policy to the teacher,
    per token (sampled-token estimate: mean of behaviour logprob - teacher logprob), overall and
    by policy version (a sample's oldest token)."""
    out: dict = {}
    if log.schema.token_rewards:
        tr = np.concatenate([seg.read_column("samples/token_rewards") for seg in log.segments])
        steps = tr[tr != 0]
        out["token_rewards"] = {"tokens": int(len(tr)), "rewarded_tokens": int(len(steps)),
                                "mean": float(steps.mean()) if len(steps) else None}
    if log.schema.teacher_logprobs:
        tv, kl, ntok, ver = [], [], [], []
        for seg in log.segments:
            clen = seg.read_column("samples/completion_len").astype(np.int64)
            diff = seg.read_column("samples/logprobs") - seg.read_column("samples/teacher_logprobs")
            starts = np.concatenate(([0], np.cumsum(clen)[:-1]))
            kl.append(np.add.reduceat(diff.astype(np.float64), starts) if len(clen) else np.zeros(0))
            ntok.append(clen)
            tv.append(seg.read_column("samples/teacher_version"))
            ver.append(seg.min_versions())
        tv, kl, ntok, ver = map(np.concatenate, (tv, kl, ntok, ver))
        out["teacher"] = {
            "samples_by_teacher_version": _histogram(tv),
            "reverse_kl_per_token": float(kl.sum() / max(1, ntok.sum())),
            "reverse_kl_by_version": {str(int(v)): float(kl[ver == v].sum() / max(1, ntok[ver == v].sum()))
                                      for v in np.unique(ver)}}
    return out


def summarize(log: RolloutLog, progress=None, episode_examples: int = 3, tokenizer=None,
              verified: bool = False) -> dict:
    """The summary of an open log (see module docstring); every value is JSON-able. Episode logs:
    `episode_examples` episodes in full, decoded with `tokenizer` when given. ``verified``: the
    log was verified (`RolloutLog.verify`); rows in damaged blocks are left out (and counted in
    ``lost_rows``) instead of raising."""
    show = progress or (lambda msg: None)
    reward, plen, clen, finish, versions, rows = [], [], [], [], [], []
    for i, seg in enumerate(log.segments):
        show(f"inspect: reading segment {i + 1}/{len(log.segments)} ({seg.num_rows} samples)")
        col = seg.intact_column if verified else seg.read_column
        reward.append(col("samples/reward"))
        plen.append(col("samples/prompt_len"))
        clen.append(col("samples/completion_len"))
        finish.append(col("samples/finish_reason"))
        versions.append(seg.min_versions(intact_only=verified))
        keep = ~seg.damaged_rows()["samples"] if verified else slice(None)
        rows.append(np.arange(seg.first_row, seg.first_row + seg.num_rows, dtype=np.int64)[keep])
    reward, plen, clen, finish, versions, rows = map(np.concatenate,
                                                     (reward, plen, clen, finish, versions, rows))
    show("inspect: reading groups and steps")
    state = log.resume_state(verify=verified)
    records = log.step_records(intact_only=verified)
    latest_record = {step: (version, r) for step, version, r in records}  # a re-run step: last wins
    consumed_version = np.full(log.num_samples, -1, dtype=np.int64)
    for version, step_rows in latest_record.values():
        consumed_version[step_rows] = version
    at = consumed_version[rows]
    consumed = at >= 0
    # Unconsumed samples are measured against the newest version the log knows of.
    known = [latest_record[max(latest_record)][0]] if latest_record else []
    reference = max(known + ([int(versions.max())] if len(versions) else []), default=0)
    staleness = {"consumed": _histogram(at[consumed] - versions[consumed]),
                 "unconsumed": _histogram(reference - versions[~consumed]),
                 "all": _histogram(np.where(consumed, at, reference) - versions),
                 "reference_version": reference}

    by_version = {}
    for v in np.unique(versions):
        r = reward[versions == v]
        scored = r[~np.isnan(r)]
        by_version[str(int(v))] = {"samples": int(len(r)), "scored": int(len(scored)),
                                   "mean": float(scored.mean()) if len(scored) else None}
    scored = reward[~np.isnan(reward)]
    top = int(max(plen.max(initial=1), clen.max(initial=1)))
    edges = np.unique(np.linspace(0, top + 1, _LENGTH_BINS + 1).astype(np.int64))
    show(f"inspect: read {len(rows):,} samples", last=True)
    episodes = {}
    if log.schema.model_mask:
        from pipeline.apps.inspect_episodes import summarize_episodes

        episodes = {"episodes": summarize_episodes(log, episode_examples, tokenizer)}
    return {
        "path": str(log.segments[0].path.parent if log.segments else log.scan.journal.parent),
        "note": log.note, "journal": log.lag_note(),
        "run_id": log.run_id, "layout_version": max(s.version for s in log.segments),
        "record_schema": log.schema.to_dict(), "meta": log.meta,
        "segments": len(log.segments), "problems": list(log.problems),
        "samples": int(len(rows)), "lost_rows": int(log.num_samples - len(rows)),
        "groups": {"total": int(sum(state.counts.values())), **state.counts},
        "steps": len(latest_record), "step_records": len(records),
        "last_step": max(latest_record, default=-1),
        "consumed_samples": int(consumed.sum()),
        "tokens": {"prompt": int(plen.sum(dtype=np.int64)),
                   "completion": int(clen.sum(dtype=np.int64)),
                   "total": int(plen.sum(dtype=np.int64) + clen.sum(dtype=np.int64))},
        "reward": {"mean": float(scored.mean()) if len(scored) else None,
                   "scored": int(len(scored))},
        "reward_by_version": by_version,
        "staleness": staleness,
        "prompt_len": _length_stats(plen), "completion_len": _length_stats(clen),
        "length_histogram": {"edges": edges.tolist(),
                             "prompt": np.histogram(plen, edges)[0].tolist(),
                             "completion": np.histogram(clen, edges)[0].tolist()},
        "finish_reasons": {name: int((finish == i).sum()) for i, name in enumerate(FINISH_REASONS)},
        "per_token_bytes": per_token_bytes(log.schema),
        **episodes,
        "scorers": scorer_summary(log) if not (verified and log.damage) else {},
    }


def per_token_bytes(schema) -> dict[str, int]:
    """Bytes each per-token field of ``schema`` takes per token (completion fields per completion
    token, ``prompt_*`` fields per prompt token), on the wire and in the log (uncompressed): e.g.
    a sampling mask of width 8 is 8 int32 = 32 bytes, routing of 2 MoE layers x top-2 is 8 bytes."""
    return {name: int(np.dtype(dtype).itemsize * math.prod(trail))
            for name, (dtype, trail) in {**schema.token_fields(), **schema.prompt_token_fields()}.items()}


def format_text(s: dict) -> str:
    """The summary as human-readable text."""
    g = s["groups"]
    out = [f"rollout log   {s['path']}  ({s['segments']} segment(s), run {s['run_id']!r}, "
           f"layout v{s['layout_version']})"]
    if s["note"]:
        out.append(f"note          {s['note']}")
    if s["journal"]:
        out.append(f"journal       {s['journal']}")
    out += [f"problems      {p}" for p in s["problems"]]
    t = s["tokens"]
    out.append(f"samples       {s['samples']:,}  ({s['consumed_samples']:,} consumed by steps"
               + (f", {s['lost_rows']:,} rows lost to damage)" if s["lost_rows"] else ")"))
    out.append(f"tokens        {t['total']:,}  (prompt {t['prompt']:,}, completion {t['completion']:,})")
    out.append(f"groups        {g['total']:,} resolved: " + ", ".join(
        f"{o.name.lower()} {g[o.name.lower()]:,}" for o in GroupOutcome))
    out.append(f"steps         {s['steps']:,}  (last step {s['last_step']}, "
               f"{s['step_records']} records)")
    mean = s["reward"]["mean"]
    out.append(f"reward        mean {'-' if mean is None else f'{mean:.4f}'} over "
               f"{s['reward']['scored']:,} scored samples")
    out.append("reward by policy version:  version   samples    scored   mean")
    for v, r in s["reward_by_version"].items():
        m = "-" if r["mean"] is None else f"{r['mean']:.4f}"
        out.append(f"{'':27}{v:>7} {r['samples']:>9,} {r['scored']:>9,}   {m}")
    st = s["staleness"]
    out.append("staleness (trainer version at consumption - sample version; unconsumed "
               f"samples vs version {st['reference_version']}):")
    total = max(1, sum(st["all"].values()))
    for k, c in st["all"].items():
        out.append(f"  {k:>4}: {c:>9,}  {'#' * max(1, round(40 * c / total))}")
    for name, label in (("prompt_len", "prompt len"), ("completion_len", "compl. len")):
        x = s[name]
        out.append(f"{label:<14}" + ("(none)" if x["min"] is None else
                   f"min {x['min']}  mean {x['mean']:.1f}  p50 {x['p50']:.0f}  "
                   f"p90 {x['p90']:.0f}  max {x['max']}"))
    out.append("finish        " + ", ".join(f"{k} {v:,}" for k, v in s["finish_reasons"].items()))
    b = s["per_token_bytes"]
    completion = {k: v for k, v in b.items() if not k.startswith("prompt_")}
    prompt = {k: v for k, v in b.items() if k.startswith("prompt_")}
    out.append(f"per token     completion {sum(completion.values())} B: "
               + ", ".join(f"{k} {v}" for k, v in completion.items())
               + (f"; prompt {4 + sum(prompt.values())} B: prompt_ids 4, "
                  + ", ".join(f"{k} {v}" for k, v in prompt.items()) if prompt else ""))
    routing = (f"{b['prompt_routed_experts']} B per prompt token + {b['routed_experts']} B per "
               "completion token" if "routed_experts" in b else "not recorded")
    mask = f"{b['sampling_mask']} B per completion token" if "sampling_mask" in b else "not recorded"
    out.append(f"recorded      routing (prompt and completion) {routing}; sampling mask {mask}")
    if "episodes" in s:
        from pipeline.apps.inspect_episodes import format_episodes

        out += format_episodes(s["episodes"])
    sc = s.get("scorers") or {}
    if "token_rewards" in sc:
        t = sc["token_rewards"]
        mean = "-" if t["mean"] is None else f"{t['mean']:.4f}"
        out.append(f"token rewards {t['rewarded_tokens']:,} of {t['tokens']:,} tokens carry a step reward, "
                   f"mean {mean}")
    if "teacher" in sc:
        t = sc["teacher"]
        out.append("teacher       samples by teacher version: " + ", ".join(
            f"{k}: {v:,}" for k, v in t["samples_by_teacher_version"].items()))
        out.append(f"              reverse KL to the teacher per token {t['reverse_kl_per_token']:.4f}; "
                   "by policy version: " + ", ".join(
                       f"{k}: {v:.4f}" for k, v in t["reverse_kl_by_version"].items()))
    return "\n".join(out)


def plot(s: dict, out: Path) -> None:
    """Write a PNG: reward by version, staleness histogram, length histograms."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    rv = [(int(v), r["mean"]) for v, r in s["reward_by_version"].items() if r["mean"] is not None]
    ax = axes[0]
    if rv:
        ax.plot([v for v, _ in rv], [m for _, m in rv], marker="o")
    ax.set(title="mean reward by policy version", xlabel="policy version (oldest token)",
           ylabel="mean reward")
    ax = axes[1]
    hist = s["staleness"]["all"]
    ax.bar([int(k) for k in hist], list(hist.values()), color="tab:orange")
    ax.set(title="staleness", xlabel="trainer version - sample version", ylabel="samples")
    if hist:
        keys = [int(k) for k in hist]
        ax.set_xlim(min(keys) - 1, max(keys) + 1)
    for ax in axes[:2]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax = axes[2]
    h = s["length_histogram"]
    for key, color in (("prompt", "tab:green"), ("completion", "tab:blue")):
        ax.stairs(h[key], h["edges"], label=key, color=color, fill=False, linewidth=1.5)
    ax.set(title="lengths", xlabel="tokens", ylabel="samples")
    ax.legend()
    fig.suptitle(f"run {s['run_id']}: {s['samples']:,} samples, {s['steps']:,} steps")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def _summary(log: RolloutLog, args, verify: bool) -> tuple[dict | None, list[str]]:
    """(summary, damage): verified in full when ``verify`` or when a lazy check on the way finds
    damage (then the summary leaves the damaged rows out)."""
    large = log.num_samples > LARGE_LOG_SAMPLES
    tokenizer = None
    if log.schema.model_mask and args.episodes:
        from pipeline.apps.inspect_episodes import run_tokenizer

        tokenizer = run_tokenizer(Path(args.path))
    progress = _progress_printer(sys.stderr.isatty() or large)
    if verify:
        log.verify()
    try:
        return summarize(log, progress, args.episodes, tokenizer, verified=verify), log.damage
    except CorruptSegmentError as e:
        if verify:
            return None, log.damage + [str(e)]
        return _summary(log, args, True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenflow inspect", description=__doc__.split("\n")[0])
    parser.add_argument("path", help="run directory, its rollouts/ directory, or a segment file")
    parser.add_argument("--plot", metavar="OUT.png", type=Path, help="write a PNG of the summary")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--verify", action="store_true",
                        help="check every block of every segment against its digest (reads the "
                             "whole log); damage found exits 1")
    parser.add_argument("--episodes", type=int, default=3, metavar="N",
                        help="episode logs: show the last N episodes turn by turn (default 3)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            log = RolloutLog.open(args.path)
        for w in caught:
            print(f"tokenflow inspect: warning: {w.message}", file=sys.stderr)
        with log:
            summary, damage = _summary(log, args, args.verify)
        if summary is not None:
            summary = _json_safe(summary)
            summary["damage"] = damage
            if args.plot:
                plot(summary, args.plot)
    except (LogError, OSError) as e:
        print(f"tokenflow inspect: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # damage no check anticipated: still exit 2 naming it, no traceback
        print(f"tokenflow inspect: error: reading {args.path} failed ({type(e).__name__}: {e}); "
              "the log may be damaged", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary if summary is not None else {"damage": damage}, sort_keys=False))
    elif summary is not None:
        print(format_text(summary))
        if args.plot:
            print(f"plot          {args.plot}")
    for d in damage:
        print(f"tokenflow inspect: damage: {d}", file=sys.stderr)
    return 1 if damage else 0
