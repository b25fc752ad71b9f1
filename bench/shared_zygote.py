"""Benchmarks on one import of torch: ``python bench/shared_zygote.py --smoke NAME...``.

Each of these benchmarks imports torch, megatron-core and transformers before its work (~6 CPU s
of one core on a 2-core CPU machine, about half of a smoke run). Here one zygote
(`support.zygote`) imports them once: it preloads `support.layout_check.PRELOAD` (`TRAINER_PRELOAD`
and the weight-sync modules: what weight_sync's own zygote preloads, a superset of the others') and
the named benchmarks' modules, in `TRAINER_ENV` (the environment of each benchmark's own zygote):

- a benchmark whose work runs in one process (trainer, dp_balance, scorers: ``main(argv) -> report``;
  scorers starts its scorer roles as processes of their own, as in its own run) runs as a worker
  forked from the zygote, all of them at once, each with its output in its own log and
  its report written to a file by the worker;
- a benchmark that forks ranks of its own (`FORKS_RANKS`: pipeline_parallel, weight_sync,
  ``main(argv, zygote) -> report``) runs in this process meanwhile, one after the other, and forks
  its ranks from the same zygote (weight_sync: its layout and LoRA runs' ranks and receivers; its
  bandwidth part's receiver is this process and its sender a process of its own, as in its own run;
  given a zygote, weight_sync runs all its parts but the stall, which needs an engine:
  bench/shared_engine.py runs it);
- every worker has the zygote's environment (`TRAINER_ENV`: one OpenMP thread each, as the ranks of
  a zygote-forked harness), so figures of a worker are those of a one-thread run; the options
  given (e.g. ``--smoke``: each benchmark's own smoke sizes) go to every benchmark.

Example (``--smoke trainer dp_balance pipeline_parallel weight_sync scorers``): trainer, dp_balance
and scorers forked at once; meanwhile pipeline_parallel's tp1 rank and its two pp2 ranks, then
weight_sync's layout and LoRA runs (trainer ranks and receivers: TP2 x EP2, TP1, TP1 with LoRA
adapters) beside its bandwidth part: fifteen processes of the same imports, one import (~6 CPU s
instead of ~30 with their own).
The last line printed is one JSON object, benchmark name -> its report (the keys of its own run).
"""
from __future__ import annotations

import importlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the package, the tests' helpers (support.zygote)

FORKS_RANKS = ("pipeline_parallel", "weight_sync")
"""Benchmarks that fork processes from the zygote themselves: run in this process, given the zygote."""
TIMEOUT_S = 900.0
"""The longest a forked benchmark may run."""


def worker(name: str, argv: list[str], out: str) -> None:
    """In a forked worker: bench/<name>.py's ``main(argv)``, its report written to ``out``."""
    report = importlib.import_module(f"bench.{name}").main(argv)
    Path(out).write_text(json.dumps(report))


def run(names: list[str], argv: list[str]) -> dict:
    from support.layout_check import PRELOAD
    from support.zygote import TRAINER_ENV, Zygote

    reports: dict = {}
    with tempfile.TemporaryDirectory(prefix="tf-shared-zygote-") as tmp, \
            Zygote([*PRELOAD, "bench.shared_zygote", *(f"bench.{n}" for n in names)],
                   Path(tmp) / "zygote.log", TRAINER_ENV) as zygote:
        forked = {name: zygote.start("bench.shared_zygote:worker",
                                     {"name": name, "argv": argv, "out": str(Path(tmp) / f"{name}.json")},
                                     Path(tmp) / f"{name}.log")
                  for name in names if name not in FORKS_RANKS}
        try:
            for name in names:
                if name in FORKS_RANKS:
                    reports[name] = importlib.import_module(f"bench.{name}").main(argv, zygote)
            status = zygote.wait(list(forked.values()), timeout_s=TIMEOUT_S)
        finally:
            zygote.kill_left(list(forked.values()))
        for name, pid in forked.items():
            if status[pid] != 0:
                raise RuntimeError(f"{name} exited {status[pid]}:\n{(Path(tmp) / f'{name}.log').read_text()[-3000:]}")
            reports[name] = json.loads((Path(tmp) / f"{name}.json").read_text())
    return {name: reports[name] for name in names}


def cli() -> None:
    names = [a for a in sys.argv[1:] if not a.startswith("-")]
    if not names:
        sys.exit(f"usage: python {sys.argv[0]} [--smoke | --quick] NAME... "
                 "(trainer dp_balance pipeline_parallel weight_sync scorers)")
    print(json.dumps(run(names, [a for a in sys.argv[1:] if a.startswith("-")])))


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    with no_process_left():
        cli()
