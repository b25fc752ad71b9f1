"""One log line, not one per tensor, for the dtype casts of a weight load.

vLLM warns for every tensor that arrives in another dtype than its parameter ("Attempted to load
weight ... with dtype torch.float32 into parameter with dtype torch.bfloat16",
``vllm.model_executor.models.utils``): an engine run in bfloat16 that receives float32 updates
logged every tensor of every update (6,077 lines after 250 steps of the demo).

Invariants:
- inside `casts_logged_once`, those warnings are counted and not emitted; the first load of the
  process that had any logs one line with the count and the first cast's text; later loads log
  nothing (the same cast, every update), `CastCounter.total` keeps counting.
- every other record of that logger, and every record outside a load, passes unchanged.

Example: an update of 27 float32 tensors into a bfloat16 engine logs once
"27 tensors of this update were cast to the engine's dtype (first: Attempted to load weight
model.embed_tokens.weight with dtype torch.float32 into parameter with dtype torch.bfloat16);
later updates cast the same way without a log line"; the next 249 updates log none.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

VLLM_CAST_LOGGER = "vllm.model_executor.models.utils"
_CAST_MESSAGE = "Attempted to load weight"


class CastCounter(logging.Filter):
    """Counts and swallows the cast warnings of the load in progress (see the module invariants)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_load = 0
        self.first: str | None = None
        self.total = 0
        self.reported = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_CAST_MESSAGE):
            return True
        self.in_load += 1
        self.total += 1
        if self.first is None:
            self.first = record.getMessage()
        return False


_counter = CastCounter()


@contextlib.contextmanager
def casts_logged_once(log: logging.Logger) -> Iterator[CastCounter]:
    """Count vLLM's per-tensor cast warnings of one load; the process's first load with any logs
    one line on `log` with their count."""
    vllm_log = logging.getLogger(VLLM_CAST_LOGGER)
    _counter.in_load = 0
    vllm_log.addFilter(_counter)
    try:
        yield _counter
    finally:
        vllm_log.removeFilter(_counter)
        if _counter.in_load and not _counter.reported:
            _counter.reported = True
            log.warning("%d tensors of this update were cast to the engine's dtype (first: %s); later "
                        "updates cast the same way without a log line", _counter.in_load, _counter.first)
