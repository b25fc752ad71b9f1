"""Routing statistics of an MoE trainer: per-layer expert load, load imbalance, dropped tokens.

A forward hook on each megatron ``TopKRouter`` reads the routing map the router returns (after
capacity dropping, when a capacity is set) for the tokens of the current micro-batch, masked to
real tokens (padding positions are routed too, but are not counted). ``collect`` sums the counts
over the world (each layer counted by the pipeline stage that holds it) and divides out the ranks
that routed the same tokens (the tensor-parallel ranks
when sequence parallelism is off), so the numbers describe the global batch on every layout.

Metrics of one ``collect`` (for L = layer, E = expert), over the tokens of the step's training
forwards:
    moe_load_l{L}_e{E}   fraction of layer L's routed assignments that went to expert E (sums to 1)
    moe_imbalance_l{L}   max over experts of the load divided by the mean load (1 = balanced)
    moe_dropped_l{L}     assignments dropped by the capacity limit (tokens x top-k - routed)
    moe_imbalance_max, moe_dropped   the worst layer's imbalance, all layers' drops

Worked example: 4 experts, top-2, 10 real tokens, layer 0 routes [8, 6, 4, 2] assignments:
load [0.4, 0.3, 0.2, 0.1], mean 0.25, imbalance 1.6, dropped 20 - 20 = 0.
"""
from __future__ import annotations


class RoutingStats:
    def __init__(self, model, sequence_parallel: bool):
        import torch
        from megatron.core.transformer.moe.router import TopKRouter

        from .conversion import unwrap

        self.routers = [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]
        if not self.routers:
            raise ValueError("the model has no MoE router")
        self.experts = self.routers[0].config.num_moe_experts
        self.topk = self.routers[0].topk
        self.sequence_parallel = sequence_parallel
        layers = self.routers[0].config.num_layers  # the whole model's: a pipeline stage holds some
        self.counts = torch.zeros(layers, self.experts, dtype=torch.float64)
        self.tokens = torch.zeros(layers, dtype=torch.float64)
        self.real = None  # [rows, S] bool of the current micro-batch: positions that hold real tokens
        for router in self.routers:  # rows by global layer (megatron's layer_number counts from 1)
            router.register_forward_hook(self._hook(router.layer_number - 1))

    def track(self, real) -> None:
        """Count the next forwards' routing at these real positions ([rows, S] bool; None: stop)."""
        self.real = real

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            from megatron.core import parallel_state as ps

            if self.real is None:
                return
            seq, rows = inputs[0].shape[:2]  # [S (this rank's shard under SP), B, H]
            first = ps.get_tensor_model_parallel_rank() * seq if self.sequence_parallel else 0
            real = self.real[:, first:first + seq].transpose(0, 1).reshape(-1)  # megatron's s-major order
            routing_map = output[1].detach().cpu()[real]
            self.counts[layer] += routing_map.sum(0).double()
            self.tokens[layer] += float(real.sum())
        return hook

    def collect(self, all_reduce, tp_size: int) -> dict[str, float]:
        """The metrics since the last ``collect`` (a collective over the world), then reset."""
        import torch

        total = all_reduce(torch.cat([self.counts.reshape(-1), self.tokens]), None).cpu()
        duplicates = 1 if self.sequence_parallel else tp_size
        n = self.counts.numel()
        counts = total[:n].reshape(self.counts.shape) / duplicates
        tokens = total[n:] / duplicates
        self.counts.zero_()
        self.tokens.zero_()
        out: dict[str, float] = {}
        dropped_all = 0.0
        imbalance_max = 0.0
        for layer in range(len(self.counts)):
            routed = float(counts[layer].sum())
            load = counts[layer] / max(routed, 1.0)
            imbalance = float(load.max() * self.experts) if routed else 0.0
            dropped = float(tokens[layer] * self.topk - routed)
            for e in range(self.experts):
                out[f"moe_load_l{layer}_e{e}"] = float(load[e])
            out[f"moe_imbalance_l{layer}"] = imbalance
            out[f"moe_dropped_l{layer}"] = dropped
            dropped_all += dropped
            imbalance_max = max(imbalance_max, imbalance)
        out["moe_imbalance_max"] = imbalance_max
        out["moe_dropped"] = dropped_all
        return out
