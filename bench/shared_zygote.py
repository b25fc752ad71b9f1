"""Trainer benchmarks on one import: ``python bench/shared_zygote.py --smoke trainer dp_balance pipeline_parallel``.

Each of these benchmarks imports torch, megatron-core and transformers before its work (~6 CPU s
of one core on a 2-core CPU machine, about half of a smoke run). Here one zygote
(`support.zygote`: `TRAINER_PRELOAD` and the named benchmarks' modules) imports them once:

- a benchmark whose work runs in one process (trainer, dp_balance: ``main(argv) -> report``) runs
  as a worker forked from the zygote, all of them at once, each with its output in its own log and
  its report written to a file by the worker;
- a benchmark that forks ranks of its own (`FORKS_RANKS`: pipeline_parallel,
  ``main(argv, zygote) -> report``) runs in this process meanwhile and forks its ranks from the
  same zygote;
- every worker has the zygote's environment (`TRAINER_ENV`: one OpenMP thread each, as the ranks of
  a zygote-forked harness), so figures of a worker are those of a one-thread run; the options
  given (e.g. ``--smoke``: each benchmark's own smoke sizes) go to every benchmark.

Example: trainer and dp_balance forked at once, then pipeline_parallel's tp1 rank and its two pp2
ranks: four processes of the same imports, one import (~6 CPU s instead of ~18 with their own).
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

FORKS_RANKS = ("pipeline_parallel",)
"""Benchmarks that fork processes from the zygote themselves: run in this process, given the zygote."""
TIMEOUT_S = 900.0
"""The longest a forked benchmark may run."""


def worker(name: str, argv: list[str], out: str) -> None:
    """In a forked worker: bench/<name>.py's ``main(argv)``, its report written to ``out``."""
    report = importlib.import_module(f"bench.{name}").main(argv)
    Path(out).write_text(json.dumps(report))


def run(names: list[str], argv: list[str]) -> dict:
    from support.zygote import TRAINER_ENV, TRAINER_PRELOAD, Zygote

    reports: dict = {}
    with tempfile.TemporaryDirectory(prefix="tf-shared-zygote-") as tmp, \
            Zygote([*TRAINER_PRELOAD, "bench.shared_zygote", *(f"bench.{n}" for n in names)],
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
        sys.exit(f"usage: python {sys.argv[0]} [--smoke | --quick] NAME... (trainer dp_balance pipeline_parallel)")
    print(json.dumps(run(names, [a for a in sys.argv[1:] if a.startswith("-")])))


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    with no_process_left():
        cli()
