"""The environment of a process a test starts: this process's, read when the child starts.

Read at call time, not at import: the per-test process marker (`conftest.no_process_left_behind`)
is set in ``os.environ`` just before each test, and only a child that inherits it is found and
ended if the test leaves it behind (a Slurm job's tasks inherit it through ``sbatch``'s
``--export=ALL``).
"""
from __future__ import annotations

import os


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` now, unbuffered Python output, and `extra`."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
