"""``tokenflow status RUN_DIR [--json]`` (see pipeline.apps.ops)."""
from pipeline.apps.ops import status_main as main

__all__ = ["main"]
