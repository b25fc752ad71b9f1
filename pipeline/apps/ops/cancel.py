"""``tokenflow cancel RUN_DIR`` (see pipeline.apps.ops)."""
from pipeline.apps.ops import cancel_main as main

__all__ = ["main"]
