"""Each importance-correction preset against an independent loop implementation (1e-6)."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.trainer.config import LossConfig, TrainerConfig
from pipeline.trainer.corrections import PRESETS, check_trainer_config
from pipeline.trainer.loss import policy_loss

torch.set_num_threads(1)

# The presets written out from their definitions (paper bounds etc.), not read from PRESETS.
SPEC = {  # name: (level, what is done with the weight, default band)
    "none": ("token", "none", None),
    "token_tis": ("token", "truncate", None),
    "seq_tis": ("sequence", "truncate", None),
    "token_mis": ("token", "mask+weight", (0.5, 2.0)),
    "seq_mis": ("sequence", "mask+weight", (0.5, 2.0)),
    "geo_mask": ("geometric", "mask only", (0.9, 1.1)),
    "icepop": ("token", "mask+weight", (0.5, 5.0)),
}


def loop_weights(prox, behaviour, mask, name, cap, band):
    """Per-token (weight, kept, raw weight) lists, sequence by sequence, in Python floats."""
    level, action, default_band = SPEC[name]
    low, high = band or default_band or (0.0, math.inf)
    out = []
    for i in range(len(mask)):
        ts = [t for t in range(len(mask[i])) if mask[i][t]]
        diffs = {t: prox[i][t] - behaviour[i][t] for t in ts}
        row = {}
        for t in ts:
            if level == "token":
                raw = math.exp(diffs[t])
            elif level == "sequence":
                raw = math.exp(sum(diffs.values()))
            else:
                raw = math.exp(sum(diffs.values()) / len(ts))
            if action == "none":
                row[t] = (1.0, True, raw)
            elif action == "truncate":
                row[t] = (min(raw, cap), True, raw)
            else:
                kept = low <= raw <= high
                row[t] = (raw if action == "mask+weight" else 1.0, kept, raw)
        out.append(row)
    return out


def loop_loss(logp, prox, behaviour, adv, mask, normaliser, cfg, band):
    weights = loop_weights(prox.tolist(), behaviour.tolist(), mask.tolist(), cfg.correction,
                           cfg.tis_cap, band)
    total = 0
    counts = {"truncated": 0, "masked": 0, "weight": 0.0, "max": 0.0}
    for i, row in enumerate(weights):
        terms = []
        for t, (w, kept, raw) in row.items():
            counts["weight"] += raw
            counts["max"] = max(counts["max"], raw)
            counts["truncated"] += cfg.correction.endswith("_tis") and raw > cfg.tis_cap
            counts["masked"] += not kept
            ratio = torch.exp(logp[i, t] - prox[i, t])
            a = float(adv[i])
            lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
            c = min(max(float(ratio), lo), hi)
            pg = -c * a + 0 * ratio if c * a < float(ratio) * a else -ratio * a
            terms.append(w * pg if kept else 0 * pg)
        total = total + (sum(terms) if cfg.aggregation == "token" else sum(terms) / len(terms))
    return total / normaliser, counts


def inputs(seed, rows=6, tokens=9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, tokens, generator=g, dtype=torch.float64) * 3
    prox = logp + 0.2 * torch.randn(rows, tokens, generator=g, dtype=torch.float64)
    behaviour = prox + 0.35 * torch.randn(rows, tokens, generator=g, dtype=torch.float64)
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, tokens, generator=g) > 0.25).double()
    mask[:, 0] = 1
    return logp, prox, behaviour, adv, mask


def test_every_preset_is_specified():
    assert set(PRESETS) == set(SPEC)


@pytest.mark.parametrize("name", sorted(SPEC))
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_preset_matches_loop_reference(name, aggregation):
    bands = [None, (0.8, 1.25)] if SPEC[name][2] else [None]
    exercised = {"truncated": 0, "masked": 0, "kept": 0}
    for band in bands:
        cfg = LossConfig(correction=name, tis_cap=1.4, clip_eps_high=0.28, aggregation=aggregation,
                         is_low=band and band[0], is_high=band and band[1])
        for seed in range(4):
            logp, prox, behaviour, adv, mask = inputs(seed)
            normaliser = float(mask.sum()) + 3 if aggregation == "token" else mask.shape[0] + 1
            x = logp.clone().requires_grad_(True)
            loss, m = policy_loss(x, behaviour, adv, mask, normaliser, cfg, proximal_logprobs=prox)
            loss.backward()
            y = logp.clone().requires_grad_(True)
            want, counts = loop_loss(y, prox, behaviour, adv, mask, normaliser, cfg, band)
            want.backward()
            assert abs(float(loss) - float(want)) < 1e-6
            assert torch.allclose(x.grad, y.grad, atol=1e-6)
            assert int(m["is_truncated"]) == counts["truncated"]
            assert int(m["is_masked"]) == counts["masked"]
            assert abs(float(m["is_weight"]) - counts["weight"]) < 1e-6 * max(1.0, counts["weight"])
            assert abs(float(m["is_weight_max"]) - counts["max"]) < 1e-6 * max(1.0, counts["max"])
            exercised["truncated"] += counts["truncated"]
            exercised["masked"] += counts["masked"]
            exercised["kept"] += int(mask.sum()) - counts["masked"]
    # the inputs reach both sides of each preset's decision
    if name.endswith("_tis"):
        assert 0 < exercised["truncated"]
    if SPEC[name][2]:
        assert exercised["masked"] > 0 and exercised["kept"] > 0


def test_masked_tokens_get_no_gradient_but_keep_their_place_in_the_normaliser():
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor([[0.0, -3.0]], dtype=torch.float64)  # weights [1, e^3 = 20.1]
    loss, m = policy_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), 2,
                          LossConfig(correction="icepop"))
    loss.backward()
    assert logp.grad.tolist() == [[-0.5, 0.0]] and int(m["is_masked"]) == 1


def test_bad_preset_and_settings_are_named():
    with pytest.raises(ValueError, match="not a correction preset"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), 1,
                    LossConfig(correction="tis"))
    with pytest.raises(ValueError, match="is_low < is_high"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), 1,
                    LossConfig(correction="token_mis", is_low=2.0, is_high=1.0))
    with pytest.raises(ValueError, match="recompute_proximal"):
        check_trainer_config(TrainerConfig(mini_batches=2))
    check_trainer_config(TrainerConfig(mini_batches=2, recompute_proximal=True))
