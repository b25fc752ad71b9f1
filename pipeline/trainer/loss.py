"""RL losses for the trainer: GRPO advantages and a PPO-clip policy loss with truncated IS and KL.

Pure torch functions on ``[rows, tokens]`` tensors with a 0/1 ``mask`` (1 = a completion token
that is trained on). Invariants:
- Nothing here communicates. The caller passes the GLOBAL normaliser (token count, or sequence
  count for sequence aggregation, summed over data-parallel ranks and micro-batches), so summing
  the returned losses over all micro-batches and ranks gives exactly the loss of the whole batch.
- Importance weights used as multipliers (TIS) are detached; the PPO ratio is not.
- Metrics are returned as SUMS over masked tokens (or sequences); divide by the same global
  normaliser after an all-reduce.

Definitions (per token t, ``A`` the advantage of the token's sequence):
  old      = proximal logprobs if given (decoupled PPO), else behaviour logprobs
  ratio    = exp(logp - old)
  pg       = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
  tis      = min(exp(old - behaviour), cap)            (1 when old is the behaviour policy)
  kl (k3)  = exp(ref - logp) - (ref - logp) - 1         (only with reference logprobs)
  loss_t   = tis * pg + kl_coef * kl
  token aggregation:    loss = sum_t loss_t / N_tokens_global
  sequence aggregation: loss = sum_rows (mean_t over the row's tokens of loss_t) / N_rows_global

Worked example (token aggregation, eps = 0.2, no proximal, no KL): one row of 2 tokens, A = +1,
logp - behaviour = [log 1.5, log 0.9], global token count 4:
  ratio = [1.5, 0.9]; clipped = [1.2, 0.9]; pg = [-1.2, -0.9]; loss = (-1.2 - 0.9) / 4 = -0.525;
  the first token is clipped (clip count 1): its gradient is zero.
"""
from __future__ import annotations

import torch

from .config import LossConfig


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, std_norm: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: ``(r - mean of the group) / (std of the group + eps)``.

    ``std`` is the population standard deviation (divide by n). A group of identical rewards gets
    zero advantages. Example: rewards [1, 0, 0, 1] in one group -> mean 0.5, std 0.5 ->
    advantages [~1, ~-1, ~-1, ~1].
    """
    rewards = rewards.double()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, rewards)
    means = sums / counts
    centered = rewards - means[inverse]
    if not std_norm:
        return centered.float()
    var = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, centered ** 2) / counts
    return (centered / (var.sqrt()[inverse] + eps)).float()


def policy_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, normaliser: float,
                cfg: LossConfig, proximal_logprobs: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss contribution of these rows and metric sums (see the module docstring).

    Shapes: logprobs, behaviour/proximal/ref logprobs and mask are ``[rows, tokens]``; advantages
    is ``[rows]`` (one per sequence) or ``[rows, tokens]``. ``normaliser`` is the global token count
    (token aggregation) or global row count (sequence aggregation).
    Metric sums (over masked tokens): ``clipped`` (tokens whose clipped branch is active),
    ``tis_clipped`` (tokens whose IS weight hit the cap), ``kl``, ``ratio``, ``tokens``.
    """
    if cfg.aggregation not in ("token", "sequence"):
        raise ValueError(f"aggregation must be 'token' or 'sequence', got {cfg.aggregation!r}")
    if normaliser <= 0:
        raise ValueError(f"normaliser must be positive, got {normaliser}")
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logprobs.dtype)
    behaviour = behaviour_logprobs.to(logprobs.dtype)
    old = behaviour if proximal_logprobs is None else proximal_logprobs.to(logprobs.dtype)

    ratio = torch.exp(logprobs - old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * advantages
    pg = -torch.minimum(unclipped, clipped)
    raw_weight = torch.exp(old - behaviour).detach()
    tis = torch.clamp(raw_weight, max=cfg.tis_cap)
    per_token = tis * pg
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        delta = ref_logprobs.to(logprobs.dtype) - logprobs
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + cfg.kl_coef * kl
    elif cfg.kl_coef:
        raise ValueError("kl_coef is set but no reference logprobs were given")

    if cfg.aggregation == "token":
        loss = (per_token * mask).sum() / normaliser
    else:
        row_tokens = mask.sum(dim=1).clamp(min=1)
        loss = ((per_token * mask).sum(dim=1) / row_tokens).sum() / normaliser
    with torch.no_grad():
        metrics = {
            "clipped": ((clipped < unclipped).to(mask.dtype) * mask).sum(),
            "tis_clipped": ((raw_weight > cfg.tis_cap).to(mask.dtype) * mask).sum(),
            "kl": (kl * mask).sum(),
            "ratio": (ratio * mask).sum(),
            "tokens": mask.sum(),
        }
    return loss, metrics
