"""Per-token rewards in the policy loss (`pipeline.trainer.loss`, "Per-token rewards"): the
advantages and gradients against a plain-Python loop over tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.trainer.config import LossConfig
from pipeline.trainer.loss import policy_loss, reward_to_go, token_advantages


def _loop_token_advantages(adv: float, rewards: list[float], coef: float) -> list[float]:
    out = []
    for t in range(len(rewards)):
        later = 0.0
        for r in rewards[t:]:
            later += r
        out.append(adv + coef * later)
    return out


def test_worked_example_from_module_docstring():
    assert reward_to_go(np.array([0, 2, 0, -1], np.float32)).tolist() == [1, 1, -1, -1]
    adv = token_advantages(torch.tensor([0.5]), torch.tensor([[1.0, 1.0, -1.0, -1.0]]), 0.1)
    assert adv[0].tolist() == pytest.approx([0.6, 0.6, 0.4, 0.4])


def test_gradient_is_per_token_advantage_of_a_loop_reference():
    """Two rows of different lengths (padded), the second an episode whose environment tokens
    (mask 0) carry a step reward: the gradient of each trained token is -A_t / N with A_t from
    the loop reference; untrained and padding tokens get none."""
    rng = np.random.default_rng(0)
    coef = 0.3
    rewards = [rng.normal(size=5).astype(np.float32), np.array([0, 0, 1.5, -0.5], np.float32)]
    seq_adv = [0.7, -1.2]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 1, 0]], dtype=torch.float32)  # row 1: tokens 1-2 env, 4 pad
    returns = torch.zeros(2, 5)
    for i, r in enumerate(rewards):
        returns[i, :len(r)] = torch.from_numpy(reward_to_go(r))
    logp = torch.log(torch.rand(2, 5, generator=torch.Generator().manual_seed(1)) * 0.5 + 0.25).requires_grad_()
    cfg = LossConfig(correction="none", token_reward_coef=coef)
    normaliser = float(mask.sum())
    adv = token_advantages(torch.tensor(seq_adv), returns, coef)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, normaliser, cfg)
    loss.backward()
    for i, r in enumerate(rewards):
        ref = _loop_token_advantages(seq_adv[i], r.tolist(), coef)
        for t in range(5):
            want = -ref[t] / normaliser if t < len(r) and mask[i, t] else 0.0
            assert float(logp.grad[i, t]) == pytest.approx(want, abs=1e-6), (i, t)
    # the environment reward at token 2 of row 1 credits the trained token 0 before it
    assert float(adv[1, 0]) == pytest.approx(-1.2 + coef * (1.5 - 0.5))


def test_off_and_missing():
    adv = torch.tensor([0.5, -0.5])
    assert token_advantages(adv, None, 0.0) is adv
    with pytest.raises(ValueError, match="token_reward_coef"):
        token_advantages(adv, None, 0.1)
    with pytest.raises(ValueError, match="finite 1-D"):
        reward_to_go(np.array([1.0, np.nan]))
