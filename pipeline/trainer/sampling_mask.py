"""Keep Sampling Mask in the trainer: logprobs renormalised over the set sampling kept.

A generator sampling with top-k/top-p draws token y from ``p(y) / P(K)`` over the kept set K
(``pipeline/generator/capture.py`` records K per generated token); its behaviour logprob is
``log p(y) - log P(K)``. The trainer scores the same distribution::

    logp_K(y) = logp(y) - log sum_{j in K} p(j) = logit(y) - logsumexp_{j in K} logit(j)

Invariants:
- ``attach_kept_ids`` places each sample's sets where the batch layout placed its completion
  tokens (``extras['kept_ids']``, -1 padded; positions without a set: prompt, padding, samples
  without a mask); `pipeline.trainer.logprobs` computes ``logp_K`` from them, chunked and
  vocabulary-parallel, with the normaliser over K (over the whole vocabulary where there is none).

Worked example: logits [2, 1, 0] (T = 1), kept {0, 1}, label 1: full logp(1) = 1 - 2.408 = -1.408,
log P(K) = log(e^2 + e^1) - 2.408 = 2.313 - 2.408 = -0.095, so logp_K(1) = -1.313.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def attach_kept_ids(micro_batches: Sequence, samples: Sequence, device) -> list:
    """Set ``extras['kept_ids']`` ([rows, S, W], -1 padded) on micro-batches holding a sample with
    a ``sampling_mask``; rows are placed like the layout places completion tokens."""
    for mb in micro_batches:
        masks = [samples[i].sampling_mask if i >= 0 else None for i in mb.sample_index]
        if all(m is None for m in masks):
            continue
        width = max(m.shape[1] for m in masks if m is not None)
        rows, length = mb.loss_mask.shape
        kept = np.full((rows, length, width), -1, dtype=np.int64)
        for m, row, start, c in zip(masks, mb.rows, mb.starts, mb.lengths):
            if m is not None:
                if len(m) != c:
                    raise ValueError(f"sampling_mask has {len(m)} rows for {c} completion tokens")
                kept[row, start:start + c, :m.shape[1]] = m
        mb.extras["kept_ids"] = torch.from_numpy(kept).to(device)
    return list(micro_batches)
