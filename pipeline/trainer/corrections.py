"""Off-policy importance corrections as named presets (``trainer.loss.correction``).

The policy loss is decoupled PPO: the PPO ratio is taken against the *proximal* policy (the
trainer's policy at the start of the optimizer step) and an importance weight
``w = pi_proximal / pi_behaviour`` corrects for the generator having sampled from another policy
(an older version, and an engine whose numerics differ: bf16, other kernels, other routing). This
module turns per-token log weights ``d_t = log pi_proximal - log pi_behaviour`` into the weight
that multiplies each token's policy-gradient term and a 0/1 ``keep`` that drops it.

Presets (``PRESETS``); ``cap`` is ``loss.tis_cap``, ``[low, high]`` are ``loss.is_low``/``is_high``
or the preset's defaults:

==========  ===========================================  ==================================
name        weight of token t of sequence s              kept (gets a policy gradient) when
==========  ===========================================  ==================================
none        1                                            always
token_tis   min(exp(d_t), cap)              (default)    always
seq_tis     min(exp(sum_t d_t), cap)                     always
token_mis   exp(d_t)                                     low <= exp(d_t) <= high
seq_mis     exp(sum_t d_t)                               low <= exp(sum_t d_t) <= high
geo_mask    1                                            low <= exp(mean_t d_t) <= high
icepop      exp(d_t)                                     low <= exp(d_t) <= high, [0.5, 5]
==========  ===========================================  ==================================

``icepop`` is token-level masked IS with the bounds of the IcePop paper (alpha 0.5, beta 5);
``geo_mask`` rejects whole sequences whose geometric-mean weight leaves the band (no reweighting).
Sums and means over t run over the sequence's completion tokens (``mask`` = 1).

Invariants:
- Weights and ``keep`` are detached: they scale gradients, they never receive any.
- A dropped token keeps its place in the loss normaliser (the global token or row count), so the
  loss of the whole batch stays the sum of the micro-batches' losses.
- Log weights are clamped to ``[-LOG_W_LIMIT, LOG_W_LIMIT]`` before ``exp`` so a long sequence's
  product cannot overflow (``exp(60)`` ~ 1e26: still far outside any band or above any cap).
- Metric sums count tokens (a sequence-level decision counts once per token of the sequence):
  ``is_weight`` (sum of the untruncated weight of the preset's level), ``is_weight_max``,
  ``is_truncated`` (weight above the cap), ``is_masked`` (dropped by the band).

Worked example (seq_tis, cap 2): a sequence with d = [0.5, 0.4, -0.2] has sequence weight
exp(0.7) = 2.01 > 2, so every one of its 3 tokens is multiplied by 2 and counts as truncated;
under token_tis its weights are [1.65, 1.49, 0.82], none truncated; under geo_mask with band
[0.9, 1.1], exp(0.7 / 3) = 1.26 lies outside: all 3 tokens are masked.

With ONE mini-batch per step the proximal policy is the current one: callers pass
``logprobs.detach()`` (no extra forward); with several mini-batches it must be recomputed before
the first update (``trainer.recompute_proximal``), which ``check_trainer_config`` enforces.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_W_LIMIT = 60.0


@dataclass(frozen=True)
class Preset:
    """How a correction turns log weights into multipliers and masks."""

    level: str
    """"token", "sequence" (product over the sequence) or "geometric" (geometric mean)."""
    mode: str
    """"none" (weight 1), "truncate" (min(w, cap)) or "mask" (drop outside [low, high])."""
    low: float = 0.0
    """Default lower bound of the band (mask mode)."""
    high: float = float("inf")
    """Default upper bound of the band (mask mode)."""
    reweight: bool = True
    """Mask mode: multiply kept tokens by their weight (False: rejection only, weight 1)."""


PRESETS: dict[str, Preset] = {
    "none": Preset("token", "none"),
    "token_tis": Preset("token", "truncate"),
    "seq_tis": Preset("sequence", "truncate"),
    "token_mis": Preset("token", "mask", 0.5, 2.0),
    "seq_mis": Preset("sequence", "mask", 0.5, 2.0),
    "geo_mask": Preset("geometric", "mask", 0.9, 1.1, reweight=False),
    "icepop": Preset("token", "mask", 0.5, 5.0),
}


def preset(name: str) -> Preset:
    """The preset called ``name``; a clear error for an unknown one."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"trainer.loss.correction={name!r} is not a correction preset; "
                         f"choose one of {sorted(PRESETS)}") from None


def band(cfg) -> tuple[float, float]:
    """``[low, high]`` of the configured preset: ``cfg.is_low``/``is_high`` where set."""
    p = preset(cfg.correction)
    low = p.low if cfg.is_low is None else cfg.is_low
    high = p.high if cfg.is_high is None else cfg.is_high
    if not 0 <= low < high:
        raise ValueError(f"importance-weight band must satisfy 0 <= is_low < is_high, got [{low}, {high}]")
    return low, high


def check_trainer_config(cfg) -> None:
    """Refuse settings under which the proximal policy would be wrong (``cfg``: TrainerConfig)."""
    preset(cfg.loss.correction)
    band(cfg.loss)
    if cfg.mini_batches > 1 and not cfg.recompute_proximal:
        raise ValueError(
            f"trainer.mini_batches={cfg.mini_batches} needs trainer.recompute_proximal=true: after the "
            "first optimizer step the current policy is no longer the proximal one")


def importance_weights(log_w: torch.Tensor, mask: torch.Tensor, cfg
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(weight, keep, metric sums)`` for ``[rows, tokens]`` log weights ``log pi_prox - log pi_behav``.

    ``cfg`` is the LossConfig (``correction``, ``tis_cap``, ``is_low``, ``is_high``). Rows are whole
    sequences; ``mask`` marks their completion tokens.
    """
    p = preset(cfg.correction)
    low, high = band(cfg)
    mask = mask.to(log_w.dtype)
    d = log_w.detach() * mask
    if p.level == "token":
        level_log_w = d
    elif p.level == "sequence":
        level_log_w = d.sum(dim=1, keepdim=True).expand_as(d)
    else:
        level_log_w = (d.sum(dim=1) / mask.sum(dim=1).clamp(min=1))[:, None].expand_as(d)
    raw = torch.exp(level_log_w.clamp(-LOG_W_LIMIT, LOG_W_LIMIT))
    ones = torch.ones_like(raw)
    truncated = torch.zeros_like(raw)
    keep = ones
    if p.mode == "none":
        weight = ones
    elif p.mode == "truncate":
        weight = torch.clamp(raw, max=cfg.tis_cap)
        truncated = (raw > cfg.tis_cap).to(raw.dtype)
    else:
        keep = ((raw >= low) & (raw <= high)).to(raw.dtype)
        weight = raw if p.reweight else ones
    metrics = {
        "is_weight": (raw * mask).sum(),
        "is_weight_max": (raw * mask).max() if mask.numel() else raw.new_zeros(()),
        "is_truncated": (truncated * mask).sum(),
        "is_masked": ((1 - keep) * mask).sum(),
    }
    return weight, keep, metrics
