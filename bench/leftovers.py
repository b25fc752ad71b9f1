"""Shared by every benchmark: on exit, no process the benchmark started may still be alive.

    with no_process_left():          # marks this process's environment; children inherit the mark
        print(json.dumps(main()))

On leaving the block, processes carrying the mark (wherever they were reparented to) get up to
15 s to finish; any still alive are killed, listed on stderr, and the benchmark exits 1 (its JSON
line stays the last line of stdout).
"""
from __future__ import annotations

import contextlib
import os
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository first: its packages before any file of bench/
from pipeline.supervise import MARKER_ENV  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' shared helpers
from support.leftovers import leftovers  # noqa: E402


@contextlib.contextmanager
def no_process_left():
    marker = os.environ.setdefault(MARKER_ENV, uuid.uuid4().hex)  # under a test: the test's mark
    try:
        yield
    finally:
        left = leftovers(marker, wait_s=15.0)
        if left:
            print(f"benchmark left {len(left)} process(es) behind (killed): " +
                  "; ".join(f"{pid}: {cmd[:120]}" for pid, cmd in sorted(left.items())), file=sys.stderr)
            raise SystemExit(1)
