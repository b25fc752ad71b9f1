"""Regenerate the golden curve: a small rollout log and the per-step loss and grad norm that
`tokenflow replay` of it must reproduce (checked by `tests/apps/test_golden_curve.py`).

    PYTHONPATH=. tf-heavy .venv/bin/python tests/support/golden/make_golden.py --source runs/demo

1. copies the first ``STEPS x GROUPS_PER_STEP`` stored groups (in stored order) of the source run's
   rollout log, and the part of its ``config.yaml`` replay reads (task, group size, temperature),
   into ``tests/support/golden/run/``, gzipped with ``h5repack`` (HDF5's tools, Debian ``hdf5-tools``) to
   about 80 KB;
2. replays them (`REPLAY_OVERRIDES`: trainer only, the freshly built tiny model, no warm start) and
   writes each step's ``loss`` and ``grad_norm`` to ``tests/support/golden/curve.json``.

Regenerate only when a change of the numerics is intended (new loss, new model builder, new
megatron-core); say so in the commit. Without ``--source`` the log is kept and only the curve is
recomputed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

GOLDEN = Path(__file__).resolve().parent
RUN = GOLDEN / "run"
CURVE = GOLDEN / "curve.json"
STEPS, GROUPS_PER_STEP = 3, 2
REPLAY_OVERRIDES = [f"run.steps={STEPS}", f"orchestrator.groups_per_step={GROUPS_PER_STEP}",
                    "model.warmstart_steps=0", "run.checkpoint_every=1000", "run.progress=false",
                    "logger=[]", "run.mismatch_every=0", "run.timeout_s=300", "trainer.lr=2e-4"]
"""What the golden replay runs with (the test passes the same); the learning rate is the one the curve
was recorded with (the `grpo` group's default then), pinned so a retuned demo leaves the curve as is."""


def copy_log(source: Path) -> None:
    from omegaconf import OmegaConf

    from pipeline.rollout_log.format import GroupOutcome
    from pipeline.rollout_log.reader import RolloutLog
    from pipeline.rollout_log.writer import RolloutLogWriter
    from pipeline.run_files import CONFIG_FILE, ROLLOUTS_DIR

    if RUN.exists():
        shutil.rmtree(RUN)
    RUN.mkdir(parents=True)
    old = OmegaConf.load(source / CONFIG_FILE)  # only what replay takes from the recorded run
    OmegaConf.save(OmegaConf.create({"task": {"name": old.task.name, "path": old.task.get("path")},
                                     "orchestrator": {"group_size": old.orchestrator.group_size},
                                     "generator": {"temperature": old.generator.temperature}}),
                   RUN / CONFIG_FILE)
    with RolloutLog.open(source) as log:
        g = log.groups()
        stored = np.flatnonzero(g["outcome"] == GroupOutcome.STORED)
        order = stored[np.argsort(g["first_row"][stored], kind="stable")][:STEPS * GROUPS_PER_STEP]
        writer = RolloutLogWriter(RUN / ROLLOUTS_DIR, log.schema, log.run_id, log.meta)
        for i in order:
            first, n = int(g["first_row"][i]), int(g["n_samples"][i])
            batch = log.read(np.arange(first, first + n, dtype=np.int64))
            rows = writer.append_samples(batch)
            writer.append_groups(g["group_id"][i], g["attempt"][i], GroupOutcome.STORED, rows[0], n,
                                 g["min_version"][i], g["t"][i])
        writer.close()
    (RUN / ROLLOUTS_DIR / "writer.lock").unlink(missing_ok=True)
    for seg in (RUN / ROLLOUTS_DIR).glob("segment-*.h5"):  # gzip the mostly empty chunks: ~80 KB
        packed = seg.with_suffix(".packed")
        subprocess.run(["h5repack", "-f", "GZIP=9", str(seg), str(packed)], check=True)
        os.replace(packed, seg)


def replay(out_dir: Path) -> list[dict]:
    """Run `tokenflow replay` of the golden log into ``out_dir``; its train_step records."""
    from pipeline.metrics import read_metrics

    cmd = [sys.executable, "-m", "pipeline.cli", "replay", str(RUN), f"hydra.run.dir={out_dir}",
           *REPLAY_OVERRIDES]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"replay failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return [{"step": s["step"], "loss": s["loss"], "grad_norm": s["grad_norm"]}
            for s in read_metrics(out_dir, "train_step")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, help="a recorded run directory to take the log from")
    a = p.parse_args()
    if a.source is not None:
        copy_log(a.source)
    with tempfile.TemporaryDirectory() as tmp:
        steps = replay(Path(tmp) / "replay")
    CURVE.write_text(json.dumps({"overrides": REPLAY_OVERRIDES, "steps": steps}, indent=1) + "\n")
    print(json.dumps(steps))


if __name__ == "__main__":
    main()
