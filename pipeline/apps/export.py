"""``tokenflow export RUN [--step K] [--out DIR]``: a run's checkpoint as a Hugging Face directory.

Writes ``RUN/export/step-K/`` (default: the newest complete checkpoint) without starting a trainer;
the conversion itself is `pipeline.trainer.export.export_checkpoint`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenflow export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run directory (runs/<name>)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    parser.add_argument("--out", type=Path, default=None, help="default: RUN/export/step-K")
    args = parser.parse_args(argv)
    from pipeline.run_dir import model_dir
    from pipeline.trainer.export import export_checkpoint
    from pipeline.roles.trainer import latest_checkpoint
    from pipeline.run_files import CHECKPOINTS_DIR as CHECKPOINTS, EXPORT_DIR, checkpoint_name

    run = args.run.resolve()
    if args.step is None:
        step, ckpt = latest_checkpoint(run)
    else:
        step, ckpt = args.step, run / CHECKPOINTS / checkpoint_name(args.step)
    if ckpt is None or not (ckpt / "trainer.json").exists():
        have = sorted(d.name for d in (run / CHECKPOINTS).glob("step-*")) if (run / CHECKPOINTS).is_dir() else []
        print(f"tokenflow export: no complete checkpoint {ckpt or run / CHECKPOINTS} "
              f"(have: {', '.join(have) or 'none'})", file=sys.stderr)
        return 2
    out = export_checkpoint(ckpt, args.out or run / EXPORT_DIR / checkpoint_name(step), model_dir(run))
    print(json.dumps({"export": str(out), "step": step}))
    return 0
