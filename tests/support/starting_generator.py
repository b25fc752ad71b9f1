"""A generator whose engine takes ``--start-s`` seconds to start, reporting its progress as the real one.

Runs the real `StartReporter` while an engine stand-in (a child process: the real engine cannot
start in a few seconds) uses CPU for ``--start-s`` seconds, then says Hello and stays a member
until SIGTERM. A test stops the stand-in (SIGSTOP) to make a stalled start.

    python starting_generator.py RUN_DIR --id=0 --start-s=6
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

from pipeline.config import record_schema
from pipeline.generator.start_report import StartReporter
from pipeline.protocol.links import GeneratorLink
from pipeline.protocol.transport import TransportConfig
from pipeline.run_dir import load_run_config

ENGINE = """
import time
end = time.monotonic() + {start_s}
while time.monotonic() < end:  # half a core: a slow start that progresses
    t = time.monotonic()
    while time.monotonic() - t < 0.05:
        pass
    time.sleep(0.05)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--id", type=int, default=0)
    ap.add_argument("--start-s", type=float, required=True)
    args = ap.parse_args()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    report = StartReporter(args.run_dir, args.id, TransportConfig(), 30.0)
    report.phase = "engine"
    engine = subprocess.Popen([sys.executable, "-c", ENGINE.format(start_s=args.start_s)])
    while engine.poll() is None and not stopping:
        try:
            engine.wait(0.2)
        except subprocess.TimeoutExpired:
            pass
    report.stop()
    if stopping:
        engine.kill()
        engine.wait()
        return
    link = GeneratorLink(args.run_dir, args.id, 1, record_schema(load_run_config(args.run_dir)))
    while not stopping:
        link.poll(0.1, send_credit=False)
    link.close()


if __name__ == "__main__":
    main()
