"""Each trainer loss against an independent loop-based computation on random inputs."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from pipeline.trainer.config import LossConfig
from pipeline.trainer.loss import group_advantages, policy_loss

torch.set_num_threads(1)


def reference_advantages(rewards, groups, std_norm, eps=1e-6):
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / len(members))
        out.append((r - mean) / (std + eps) if std_norm else r - mean)
    return out


def reference_loss(logp, behaviour, adv, mask, normaliser, cfg, proximal=None, ref=None):
    """Token by token, in Python scalars where the math is, torch only to carry gradients."""
    rows = []
    clipped_count = tis_count = 0
    for i in range(logp.shape[0]):
        row_terms = []
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            old = logp[i, t].detach() if proximal is None else proximal[i, t]
            ratio = torch.exp(logp[i, t] - old)
            a = float(adv[i])
            lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
            clipped_ratio = min(max(float(ratio), lo), hi)
            if clipped_ratio * a < float(ratio) * a:
                term = -clipped_ratio * a + 0 * ratio  # clipped branch: no gradient
                clipped_count += 1
            else:
                term = -ratio * a
            weight = math.exp(float(old) - float(behaviour[i, t]))
            if weight > cfg.tis_cap:
                tis_count += 1
            term = min(weight, cfg.tis_cap) * term
            if ref is not None:
                d = ref[i, t] - logp[i, t]
                term = term + cfg.kl_coef * (torch.exp(d) - d - 1)
            row_terms.append(term)
        if cfg.aggregation == "token":
            rows.append(sum(row_terms))
        else:
            rows.append(sum(row_terms) / max(len(row_terms), 1))
    return sum(rows) / normaliser, clipped_count, tis_count


def random_inputs(seed, rows=5, tokens=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, tokens, generator=g, dtype=torch.float64) * 3
    behaviour = logp + 0.4 * torch.randn(rows, tokens, generator=g, dtype=torch.float64)
    proximal = logp + 0.3 * torch.randn(rows, tokens, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(rows, tokens, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, tokens, generator=g) > 0.3).double()
    mask[:, 0] = 1
    return logp, behaviour, proximal, ref, adv, mask


def test_group_advantages_match_loop_reference():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (23,), generator=g).double()
    groups = torch.randint(0, 5, (23,), generator=g)
    for std_norm in (True, False):
        got = group_advantages(rewards, groups, std_norm=std_norm)
        want = reference_advantages(rewards.tolist(), groups.tolist(), std_norm)
        assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)


def test_group_of_equal_rewards_has_zero_advantage():
    adv = group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert adv[:2].abs().max() == 0
    assert adv[2] < 0 < adv[3]


@pytest.mark.parametrize("aggregation,use_proximal,use_ref", list(itertools.product(
    ["token", "sequence"], [False, True], [False, True])))
def test_policy_loss_and_gradient_match_loop_reference(aggregation, use_proximal, use_ref):
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=1.3,
                     kl_coef=0.1 if use_ref else 0.0, aggregation=aggregation)
    for seed in range(3):
        logp, behaviour, proximal, ref, adv, mask = random_inputs(seed)
        normaliser = float(mask.sum()) + 5 if aggregation == "token" else logp.shape[0] + 2
        kwargs = dict(proximal_logprobs=proximal if use_proximal else None,
                      ref_logprobs=ref if use_ref else None)
        x = logp.clone().requires_grad_(True)
        loss, metrics = policy_loss(x, behaviour, adv, mask, normaliser, cfg, **kwargs)
        loss.backward()
        y = logp.clone().requires_grad_(True)
        want, clipped, tis_clipped = reference_loss(
            y, behaviour, adv, mask, normaliser, cfg,
            proximal if use_proximal else None, ref if use_ref else None)
        want.backward()
        assert torch.allclose(loss, want, atol=1e-10), (float(loss), float(want))
        assert torch.allclose(x.grad, y.grad, atol=1e-10)
        assert int(metrics["clipped"]) == clipped
        assert int(metrics["is_truncated"]) == tis_clipped
        assert int(metrics["tokens"]) == int(mask.sum())
        assert tis_clipped > 0  # the cap is exercised


def test_token_loss_summed_over_splits_equals_whole_batch():
    """Global normalisation: micro-batches/ranks each divide by the global count."""
    cfg = LossConfig()
    logp, behaviour, _, _, adv, mask = random_inputs(4, rows=6)
    total = float(mask.sum())
    whole, _ = policy_loss(logp, behaviour, adv, mask, total, cfg)
    parts = sum(policy_loss(logp[i:i + 2], behaviour[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                            total, cfg)[0] for i in range(0, 6, 2))
    assert torch.allclose(whole, parts, atol=1e-12)


def test_worked_example_from_module_docstring():
    logp = torch.log(torch.tensor([[1.5, 2.5]], dtype=torch.float64))
    proximal = torch.log(torch.tensor([[1.0, 2.5]], dtype=torch.float64))
    loss, metrics = policy_loss(logp, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([1.0]),
                                torch.ones(1, 2), 4, LossConfig(), proximal_logprobs=proximal)
    assert abs(float(loss) - (-0.8)) < 1e-9
    assert int(metrics["clipped"]) == 1 and int(metrics["is_truncated"]) == 1


def test_default_without_proximal_weights_by_current_over_behaviour():
    """One mini-batch: the proximal policy is the current one, so the default token TIS weight is
    exp(logp - behaviour) (not 1) and the PPO ratio is 1 in value."""
    logp = torch.log(torch.tensor([[0.5, 0.2]], dtype=torch.float64)).requires_grad_(True)
    behaviour = torch.log(torch.tensor([[0.25, 0.2]], dtype=torch.float64))
    loss, metrics = policy_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), 2,
                                LossConfig(tis_cap=1.5))
    loss.backward()
    # d loss / d logp_t = -w_t * A / N, w = [min(2, 1.5), 1]
    assert torch.allclose(logp.grad, torch.tensor([[-0.75, -0.5]], dtype=torch.float64))
    assert float(metrics["is_weight"]) == 3.0 and float(metrics["is_weight_max"]) == 2.0
    assert int(metrics["is_truncated"]) == 1 and int(metrics["clipped"]) == 0


def test_bad_arguments_are_named():
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), 1, LossConfig(aggregation="row"))
    with pytest.raises(ValueError, match="reference"):
        policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), 1, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="normaliser"):
        policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), 0, LossConfig())
