"""The cost-balanced data-parallel split (pipeline.orchestrator.batching): the worked example, the
LPT bound on any batch, and the cost model against FLOPs counted by torch on the transformers model."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.orchestrator.batching import StepCost, split_by_cost
from pipeline.plan.shape import ModelShape


def loads(ranks, costs, dp):
    return np.bincount(ranks, weights=costs, minlength=dp)


def test_worked_example_tokens_then_cost():
    tokens = np.array([90, 50, 40, 30, 10])
    assert loads(split_by_cost(tokens, 2), tokens, 2).tolist() == [120, 100]
    cost = StepCost(linear=1.0, quadratic=0.01)
    ranks = split_by_cost(tokens, 2, cost)
    assert loads(ranks, tokens, 2).tolist() == [90, 130]
    assert loads(ranks, cost.of(tokens), 2).tolist() == pytest.approx([171, 181])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4000), min_size=1, max_size=60), st.integers(1, 8),
       st.floats(0.0, 1.0))
def test_every_sample_goes_to_one_rank_and_costs_balance(tokens, dp, quadratic):
    cost = StepCost(linear=1.0, quadratic=quadratic)
    ranks = split_by_cost(np.array(tokens), dp, cost)
    costs = cost.of(tokens)
    assert len(ranks) == len(tokens) and ranks.min() >= 0 and ranks.max() < dp
    per_rank = loads(ranks, costs, dp)
    assert per_rank.max() - per_rank.min() <= costs.max() + 1e-6 * costs.sum()


def test_cost_model_matches_flops_torch_counts_on_the_hf_model():
    """Forward + backward FLOPs of the transformers model (eager attention computes the full
    S x S scores, as megatron's local attention does) at two lengths fix linear and quadratic.
    Dense only: transformers' MoE experts run an operator torch's counter has no formula for."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from pipeline.models.tiny import TinyModelSpec

    config = TinyModelSpec(kind="dense").hf_config()
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)

    def flops(t):
        ids = torch.randint(3, config.vocab_size, (1, t))
        with FlopCounterMode(display=False) as counter:
            model(ids).logits.float().sum().backward()
        return counter.get_total_flops()

    t1, t2 = 32, 128
    f1, f2 = flops(t1), flops(t2)
    quadratic = (f2 / t2 - f1 / t1) / (t2 - t1)
    linear = f1 / t1 - quadratic * t1
    cost = StepCost.of_shape(ModelShape.from_config(config.to_dict()))
    assert cost.quadratic == pytest.approx(quadratic, rel=0.02)
    assert cost.linear == pytest.approx(linear, rel=0.05)


def test_fitted_step_cost_recovers_a_known_polynomial_and_keeps_coefficients_non_negative():
    rng = np.random.default_rng(0)
    tokens = np.repeat([128, 256, 512, 1024, 2048], 3)
    truth = 0.05 + 2e-4 * tokens + 3e-8 * tokens ** 2.0
    cost, fixed = StepCost.fit(tokens, truth * rng.normal(1.0, 0.01, len(tokens)))
    assert cost.linear == pytest.approx(2e-4, rel=0.1) and cost.quadratic == pytest.approx(3e-8, rel=0.1)
    assert fixed == pytest.approx(0.05, rel=0.2)
    # times that fall with length (noise at one length) would need a negative term: it is left out
    flat, fixed = StepCost.fit([100, 200, 300, 400], [1.0, 0.99, 0.98, 0.97])
    assert (flat.linear, flat.quadratic) == (0.0, 0.0) and fixed == pytest.approx(0.985)
    assert np.bincount(split_by_cost(np.array([100, 200, 300, 400, 500, 600]), 3, flat)).tolist() == [2, 2, 2]
    # steps of 1 and 4 samples separate each sample's own share from the step's
    samples = np.tile([1, 4], 5)
    tokens = np.repeat([128, 256, 512, 1024, 2048], 2)
    cost, fixed = StepCost.fit(tokens, 0.05 + samples * (0.01 + 2e-4 * tokens), samples)
    assert (cost.per_sample, cost.linear, cost.quadratic, fixed) == pytest.approx((0.01, 2e-4, 0.0, 0.05), abs=1e-9)
    with pytest.raises(ValueError, match=">= 3 distinct lengths"):
        StepCost.fit([100, 100, 200], [1.0, 1.1, 2.0])


def test_configured_step_cost_is_checked():
    from pipeline.orchestrator.config import OrchestratorConfig

    with pytest.raises(ValueError, match="step_cost_per_token"):
        OrchestratorConfig(step_cost_per_token=-1e-4).validate()
    OrchestratorConfig(step_cost_per_token=1e-4, step_cost_per_token_pair=1e-8).validate()
