"""The reverse-KL distillation term of `pipeline.trainer.loss.policy_loss`: its gradient, and a
tiny student distilled on its own samples towards a tiny teacher (exact KL measured over the
whole vocabulary, independently of the loss's sampled estimator)."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.trainer.config import LossConfig
from pipeline.trainer.loss import policy_loss


def test_distill_term_gradient_is_rkl_weighted_score():
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9]])).requires_grad_()
    teacher = torch.log(torch.tensor([[0.25, 0.4, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    cfg = LossConfig(pg_coef=0.0, distill_coef=1.0, correction="none")
    loss, m = policy_loss(logp, logp.detach(), torch.zeros(1), mask, 4.0, cfg, teacher_logprobs=teacher)
    loss.backward()
    rkl = [math.log(2.0), math.log(0.5)]
    assert logp.grad[0].tolist() == pytest.approx([rkl[0] / 4, rkl[1] / 4, 0.0], abs=1e-6)
    assert float(m["teacher_kl"]) == pytest.approx(sum(rkl), abs=1e-6)
    assert float(loss.detach()) == pytest.approx(sum(rkl) / 4, abs=1e-6)
    with pytest.raises(ValueError, match="teacher logprobs"):
        policy_loss(logp, logp.detach(), torch.zeros(1), mask, 4.0, cfg)


def _tiny_lm(seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=64, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # sharper distributions than the default init's near-uniform ones
        model.lm_head.weight.mul_(20.0)
    return model


def _sample(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    seq = prompts
    with torch.no_grad():
        for _ in range(n_new):
            probs = torch.softmax(model(input_ids=seq).logits[:, -1].float(), -1)
            seq = torch.cat([seq, torch.multinomial(probs, 1)], 1)
    return seq


def _token_logprobs(model, seq: torch.Tensor, plen: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=seq).logits[:, plen - 1:-1].float()
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, seq[:, plen:, None])[..., 0], logp_all


def _exact_reverse_kl(student, teacher, prompts, plen: int, n_new: int) -> float:
    """Mean over positions of student samples of KL(student(.|prefix) || teacher(.|prefix)),
    summed over the whole vocabulary."""
    torch.manual_seed(11)  # the same sampling noise before and after training
    seq = _sample(student, prompts, n_new)
    with torch.no_grad():
        _, s_all = _token_logprobs(student, seq, plen)
        _, t_all = _token_logprobs(teacher, seq, plen)
    return float((s_all.exp() * (s_all - t_all)).sum(-1).mean())


def test_distillation_lowers_reverse_kl_to_the_teacher():
    teacher, student = _tiny_lm(1), _tiny_lm(2)
    plen, n_new = 4, 6
    gen = torch.Generator().manual_seed(0)
    held_out = torch.randint(0, 32, (64, plen), generator=gen)
    torch.manual_seed(5)
    before = _exact_reverse_kl(student, teacher, held_out, plen, n_new)
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    cfg = LossConfig(pg_coef=0.0, distill_coef=1.0)
    estimates = []
    for _ in range(30):
        prompts = torch.randint(0, 32, (16, plen), generator=gen)
        seq = _sample(student, prompts, n_new)  # on-policy: the student's own samples
        with torch.no_grad():
            behaviour, _ = _token_logprobs(student, seq, plen)
            teacher_lp, _ = _token_logprobs(teacher, seq, plen)
        logp, _ = _token_logprobs(student, seq, plen)
        mask = torch.ones_like(logp)
        loss, m = policy_loss(logp, behaviour, torch.zeros(len(seq)), mask, float(mask.sum()), cfg,
                              teacher_logprobs=teacher_lp)
        opt.zero_grad()
        loss.backward()
        opt.step()
        estimates.append(float(m["teacher_kl"] / m["tokens"]))
    after = _exact_reverse_kl(student, teacher, held_out, plen, n_new)
    print(f"exact reverse KL {before:.3f} -> {after:.3f}; sampled estimate per step:",
          " ".join(f"{e:.2f}" for e in estimates))
    assert before > 0.5, f"the models must start apart (exact reverse KL {before:.3f})"
    assert after < 0.8 * before, f"reverse KL {before:.3f} -> {after:.3f}"
    assert sum(estimates[-5:]) < sum(estimates[:5]), estimates
