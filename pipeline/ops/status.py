"""``tokenflow status RUN_DIR [--json]`` (see pipeline.ops)."""
from pipeline.ops import status_main as main

__all__ = ["main"]
