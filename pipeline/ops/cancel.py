"""``tokenflow cancel RUN_DIR`` (see pipeline.ops)."""
from pipeline.ops import cancel_main as main

__all__ = ["main"]
