"""fp32 master weights for a bf16 model on the torch optimizer path.

With ``trainer.parallel.params_dtype=bfloat16`` the model's parameters are bf16. An Adam update is
often far below bf16's resolution (8 bits of mantissa: 1.0 + 1e-3 rounds back to 1.0), so applied
to bf16 weights directly most updates vanish. megatron's distributed optimizer (CUDA) keeps fp32
main parameters itself; the torch path (CPU) keeps them here: AdamW updates the fp32 masters from
the fp32 gradient (``param.main_grad``), and each step the bf16 parameters are set to the masters
rounded.

Invariants: ``masters[i]`` is parameter i's fp32 master (same order as the optimizer's params);
the parameters always equal their masters rounded to bf16; a checkpoint stores the masters (not
the rounded weights) and a load restores them exactly (`pipeline.trainer.checkpoint`).

Example: a weight 1.0 updated by -4e-4 three times: bf16 alone stays 1.0 (each update rounds
away); the master goes 0.9996, 0.9992, 0.9988 and the bf16 weight follows once it crosses a bf16
step (0.99609375 after about ten such updates).
"""
from __future__ import annotations


class MasterWeights:
    """The fp32 copies of ``params`` the optimizer updates."""

    def __init__(self, params: list) -> None:
        import torch

        self.params = list(params)
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}

    def of(self, param):
        """The master of model parameter ``param``."""
        return self.masters[self._index[id(param)]]

    def step(self, optimizer, grad_scale: float = 1.0) -> None:
        """One optimizer step on the masters from the fp32 gradients, then the rounded copy back.
        The parameters' own ``.grad`` is cleared (the optimizer's ``zero_grad`` reaches only the
        masters; a stale one would be added to the next backward's)."""
        import torch

        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                m.grad = p.main_grad.float() * grad_scale
            optimizer.step()
            self.write_back()
            for p in self.params:
                p.grad = None

    def write_back(self) -> None:
        import torch

        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m.to(p.dtype))
