"""Keep Sampling Mask: the set of token ids top-k/top-p sampling kept, captured from the engine.

The engine runs in ``processed_logprobs`` mode, whose logprobs are the log-softmax of the logits
AFTER temperature and the top-k/top-p filter: every token the filter dropped has logprob -inf, every
kept token a finite one. A request that asks for ``width + 1`` top logprobs therefore sees the whole
kept set exactly (ties at the cut-off included, since vLLM keeps every tied token and so does the
finiteness test) whenever it has at most ``width`` members; ``width + 1`` finite entries means it
has more, and the sample is refused (`SamplingMaskOverflow`) rather than stored truncated. This
needs no access to the engine's internals, so the CPU and GPU builds behave the same (on GPU
vLLM disables FlashInfer's sampler in processed modes, so the filter is its own).

Stored form (the record's ``sampling_mask`` field): per completion token one int32 row of
``width`` ids, the kept set in descending logprob order, padded with -1. Example, width 4, top_k 2,
logits of one position [3.0, 1.0, 3.0, 0.5] (a tie at the cut-off): kept = {0, 2} ->
row [0, 2, -1, -1] (or [2, 0, -1, -1]; the order carries no meaning). Cost: 4 * width bytes per
completion token, on the wire and in the log.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np


class SamplingMaskOverflow(RuntimeError):
    """The kept set of a position is wider than ``generator.sampling_mask_width``."""


def logprobs_to_request(width: int) -> int:
    """Top logprobs a sampling request asks for so that its kept sets can be read (0: none)."""
    return width + 1 if width else 0


def kept_token_ids(output: Any, width: int) -> np.ndarray:
    """``[n, width]`` int32 kept ids (-1 padded) of a CompletionOutput requested with
    ``logprobs=logprobs_to_request(width)`` in processed_logprobs mode."""
    lp = output.logprobs
    n = len(output.token_ids)
    if lp is None or not hasattr(lp, "start_indices") or len(lp.start_indices) != n:
        raise RuntimeError("the engine returned no per-position top logprobs for a sampling-mask request")
    rows = np.full((n, width), -1, dtype=np.int32)
    for i, (start, end) in enumerate(zip(lp.start_indices, lp.end_indices)):
        # entry `start` is the sampled token itself; the ranked top-(width + 1) follow
        kept = [t for t, v in zip(lp.token_ids[start + 1:end], lp.logprobs[start + 1:end]) if v > -math.inf]
        if len(kept) > width:
            raise SamplingMaskOverflow(
                f"token {i}: top-k/top-p kept more than generator.sampling_mask_width={width} ids; "
                f"raise generator.sampling_mask_width (or lower top_p)")
        if output.token_ids[i] not in kept:
            raise RuntimeError(f"token {i}: the sampled id {output.token_ids[i]} is not in its kept set "
                               f"(is generator.logprobs_mode processed_logprobs?)")
        rows[i, :len(kept)] = kept
    return rows
