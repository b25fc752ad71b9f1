"""RL losses for the trainer: GRPO advantages and a decoupled PPO-clip policy loss with
importance corrections (``corrections.py``) and KL.

Pure torch functions on ``[rows, tokens]`` tensors with a 0/1 ``mask`` (1 = a completion token
that is trained on). Invariants:
- Nothing here communicates. The caller passes the GLOBAL normaliser (token count, or sequence
  count for sequence aggregation, summed over data-parallel ranks and micro-batches), so summing
  the returned losses over all micro-batches and ranks gives exactly the loss of the whole batch.
- Importance weights and masks are detached; the PPO ratio is not.
- Metrics are returned as SUMS over masked tokens (or sequences), except ``*_max`` keys (maxima);
  divide sums by the same global normaliser after an all-reduce (SUM, MAX for ``*_max``).

Definitions (per token t, ``A`` the advantage of the token's sequence):
  prox     = proximal logprobs if given (recomputed before the step), else logp.detach() (with one
             mini-batch per step the current policy IS the proximal one: no extra forward)
  ratio    = exp(logp - prox)
  pg       = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
  w, keep  = importance_weights(prox - behaviour) of the preset ``cfg.correction``
             (default token_tis: w = min(exp(prox - behaviour), tis_cap), keep = 1)
  kl (k3)  = exp(ref - logp) - (ref - logp) - 1         (only with reference logprobs)
  rkl      = logp - teacher                             (only with teacher logprobs)
  loss_t   = pg_coef * keep * w * pg + kl_coef * kl + distill_coef * keep * w * ratio * sg(rkl)
  token aggregation:    loss = sum_t loss_t / N_tokens_global
  sequence aggregation: loss = sum_rows (mean_t over the row's tokens of loss_t) / N_rows_global

On-policy distillation (reverse KL to a teacher, `docs/scorers.md`): the per-token estimator of
KL(policy || teacher) on the policy's own samples y ~ policy is the sampled-token ("k1") estimate
rkl = log policy(y) - log teacher(y); its expectation over y is the reverse KL. Differentiating
rkl itself would give only grad log policy(y), whose expectation is zero; the gradient of the
reverse KL is E[rkl * grad log policy(y)], which ``ratio * sg(rkl)`` gives (``ratio`` is 1 with
the gradient of logp): a per-token REINFORCE term with reward -rkl (no credit to later tokens),
importance-weighted like the PG term. Metric ``teacher_kl`` sums rkl over masked tokens.
Example: logp = log 0.5, teacher = log 0.25 at one token: rkl = log 2 = 0.693; the term's gradient
pushes logp of that token down with weight 0.693 * distill_coef / N.

Per-token rewards (``token_rewards``: a process-reward scorer's step scores, an episode's
per-step environment rewards; 0 at tokens without one). With ``token_reward_coef`` c != 0 the
advantage of completion token t of a sequence with advantage A is
  A_t = A + c * sum_{t' >= t} r_t'                      (the undiscounted reward-to-go)
so a step's reward credits every token up to and including the one it is recorded at, and
nothing after it. The sum runs over every completion token, environment tokens (model_mask 0,
never trained) included: an environment reward recorded at a tool-output token still credits
the model tokens before it. Example: A = 0.5, c = 0.1, token_rewards = [0, 2, 0, -1]: the
reward-to-go is [1, 1, -1, -1] and A_t = [0.6, 0.6, 0.4, 0.4].

Worked example (token aggregation, eps = 0.2, token_tis with cap 2, no KL): one row of 2 tokens,
A = +1, behaviour = 0, proximal = [log 1.0, log 2.5], logp = [log 1.5, log 2.5], global token
count 4:
  ratio = [1.5, 1.0]; clipped = [1.2, 1.0]; pg = [-1.2, -1.0]; w = [1.0, min(2.5, 2) = 2];
  loss = (-1.2 - 2.0) / 4 = -0.8; the first token is PPO-clipped (zero gradient), the second
  token's weight is truncated (is_truncated 1).
"""
from __future__ import annotations

import numpy as np
import torch

from .config import LossConfig
from .corrections import importance_weights


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


def reward_to_go(token_rewards: np.ndarray) -> np.ndarray:
    """``out[t] = sum_{t' >= t} token_rewards[t']`` (float32; summed in float64)."""
    r = np.asarray(token_rewards, dtype=np.float64)
    if r.ndim != 1 or not np.isfinite(r).all():
        raise ValueError(f"token rewards must be a finite 1-D array, got shape {r.shape}")
    return np.cumsum(r[::-1])[::-1].astype(np.float32)


def token_advantages(advantages: torch.Tensor, token_returns: torch.Tensor | None,
                     coef: float) -> torch.Tensor:
    """Per-token advantages ``A[:, None] + coef * token_returns`` (``[rows, tokens]``, the
    returns from `reward_to_go`, laid out like the logprobs); ``advantages`` as they are when
    ``coef`` is 0. See "Per-token rewards" in the module docstring."""
    if not coef:
        return advantages
    if token_returns is None:
        raise ValueError("trainer.loss.token_reward_coef is set but no token rewards were given "
                         "(scorers.reward=process_reward, or an environment with step rewards)")
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    return adv + coef * token_returns.to(adv.dtype)


def policy_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, normaliser: float,
                cfg: LossConfig, proximal_logprobs: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None,
                teacher_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss contribution of these rows and metric sums (see the module docstring).

    Shapes: logprobs, behaviour/proximal/ref logprobs and mask are ``[rows, tokens]``; advantages
    is ``[rows]`` (one per sequence) or ``[rows, tokens]``. ``normaliser`` is the global token count
    (token aggregation) or global row count (sequence aggregation). Metric sums (over masked
    tokens): ``clipped`` (tokens whose PPO-clipped branch is active), ``kl``, ``ratio``,
    ``tokens`` and those of ``importance_weights`` (``is_weight``, ``is_weight_max``,
    ``is_truncated``, ``is_masked``).
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
    prox = logprobs.detach() if proximal_logprobs is None else proximal_logprobs.to(logprobs.dtype)

    ratio = torch.exp(logprobs - prox)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * advantages
    pg = -torch.minimum(unclipped, clipped)
    weight, keep, is_metrics = importance_weights(prox - behaviour, mask, cfg)
    per_token = cfg.pg_coef * keep * weight * pg
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        delta = ref_logprobs.to(logprobs.dtype) - logprobs
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + cfg.kl_coef * kl
    elif cfg.kl_coef:
        raise ValueError("kl_coef is set but no reference logprobs were given")
    rkl = None
    if teacher_logprobs is not None:
        rkl = logprobs.detach() - teacher_logprobs.to(logprobs.dtype)
        per_token = per_token + cfg.distill_coef * keep * weight * ratio * rkl
    elif cfg.distill_coef:
        raise ValueError("distill_coef is set but no teacher logprobs were given (scorers.teacher)")

    if cfg.aggregation == "token":
        loss = (per_token * mask).sum() / normaliser
    else:
        row_tokens = mask.sum(dim=1).clamp(min=1)
        loss = ((per_token * mask).sum(dim=1) / row_tokens).sum() / normaliser
    with torch.no_grad():
        metrics = {
            "clipped": ((clipped < unclipped).to(mask.dtype) * mask).sum(),
            "kl": (kl * mask).sum(),
            "ratio": (ratio * mask).sum(),
            "tokens": mask.sum(),
            **is_metrics,
        }
        if rkl is not None:
            metrics["teacher_kl"] = (rkl * mask).sum()
    return loss, metrics
