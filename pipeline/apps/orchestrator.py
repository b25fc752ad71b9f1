"""``python -m pipeline.apps.orchestrator RUN_DIR``: serve the orchestrator of a run directory.

Started by trainer rank 0 of a training run (or by tests and benchmarks); reads the run's resolved
``config.yaml`` and serves until the trainer says ``finish`` or the process gets SIGTERM or SIGINT
(also one that arrived during start-up).
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: tokenflow orchestrate RUN_DIR   (python -m pipeline.apps.orchestrator RUN_DIR)",
              file=sys.stderr)
        return 2
    # A stop (the trainer's SIGINT at the end of a run, or its death) that arrives while the log is
    # restored is taken after start-up: the new life closes like any other, its metrics written.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s")
    from pipeline.run_dir import load_run_config
    from pipeline.roles.orchestrator import build_orchestrator

    run_dir = Path(argv[0])
    build_orchestrator(run_dir, load_run_config(run_dir)).run(stop=stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
