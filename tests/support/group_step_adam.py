"""A stand-in for a fused Adam (Transformer Engine's, Apex's: CUDA only) that runs on CPU: plain
Adam(W) whose step count lives in ``param_groups[i]["step"]``, as theirs does, not in the
per-parameter state as torch's does. The checkpoint code must find it there."""
from __future__ import annotations

import torch


class GroupStepAdam(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, step=0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] += 1
            t, (b1, b2) = group["step"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1 ** t))
