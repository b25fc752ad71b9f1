"""Pipeline parallelism: the trainer's micro-batches through megatron-core's 1F1B schedule.

With ``trainer.parallel.pp > 1`` each rank holds one stage of the model (`model.build_gpt_model`:
its ``L / pp`` layers, the embedding on the first stage, the final norm and output layer on the
last) and `PipelineSchedule.run` replaces the trainer's plain micro-batch loop.

Invariants:
- Every rank of one pipeline (the stages of one data-parallel rank) holds the same micro-batch
  list; the schedule is megatron's (`get_forward_backward_func`: non-interleaved 1F1B), run the
  same way on every stage. Activations and their gradients travel between neighbouring stages on
  megatron's pipeline group with their shapes first (``variable_seq_lengths``), because the
  trainer's micro-batches differ in rows and width.
- The loss is normalised by the trainer (global token count, `engine`), so the schedule divides
  by nothing: ``calculate_per_token_loss`` and no ``finalize_model_grads_func`` (the trainer
  finalises the gradients itself after the schedule, as without PP).
- Only the last stage sees the output: ``on_output(mb, hidden, weight)`` (final hidden states and
  the output-weight shard, `logprobs.hidden_for_output`: no full logits) runs there, once per
  micro-batch in order, and returns ``(loss, value)``; `run` returns the values there and None elsewhere;
  `share` (logprobs) and `metric_sums` hand them to the other stages, so every rank returns what
  a rank without PP returns.
- Keep Routing: stage s replays the recorded routing of its own MoE layers, columns
  ``offset .. offset + layers - 1`` of a micro-batch's ``routed_experts`` (offset = the stage's
  first layer; every layer of a supported MoE model is an MoE layer).
- Timeouts: the schedule's sends and receives are work on megatron's pipeline group, which
  `Trainer` creates with ``distributed_timeout_minutes`` (from ``trainer.timeout_s``); gloo's
  send/recv waits use the group's timeout, so a stage whose neighbour died fails within it.

Worked example: PP2, 4 micro-batches F/B (forward/backward of micro-batch i): stage 0 runs
F0 | F1 B0 F2 B1 F3 B2 | B3 (one warm-up forward, pp - 1 - stage), stage 1 runs F0 B0 F1 B1 F2 B2
F3 B3; with equal stage times the bubble (idle share of a stage's step) is
(pp - 1) / (m + pp - 1) = 1/5.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Sequence

import numpy as np

#: Metric sums a training micro-batch may report (`loss.policy_loss`'s and the trainer's own).
STEP_SUMS = ("clipped", "entropy", "is_masked", "is_truncated", "is_weight", "is_weight_max", "kl", "loss",
             "ratio", "teacher_kl", "tokens")


class PipelineSchedule:
    """This rank's stage of the pipeline (build after megatron's groups and the model)."""

    def __init__(self, model):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from .conversion import unwrap

        self.first_layer = get_transformer_layer_offset(unwrap(model).config)
        self.group = ps.get_pipeline_model_parallel_group()
        self.is_last = ps.is_pipeline_last_stage()
        self.last_rank = ps.get_pipeline_model_parallel_last_rank()

    def run(self, model, micro_batches: Sequence, on_output: Callable, forward_only: bool,
            replayer=None, count_routing: bool = False, routing=None) -> list | None:
        """Forward (and, unless ``forward_only``, backward) every micro-batch through the
        pipeline; ``replayer`` (a `RoutingReplay` of ``model``, or None) replays and counts
        routing as the trainer's forward does, ``routing`` (`RoutingStats`, or None) counts each
        forward's expert load. Returns ``on_output``' values on the last stage, None elsewhere."""
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from .conversion import unwrap
        from .logprobs import hidden_for_output

        values = []

        def forward_step(data_iterator, stage_model):
            mb = next(data_iterator)
            real = mb.real_mask()
            if routing is not None:
                routing.track(real)
            routed = mb.extras.get("routed_experts") if replayer is not None else None
            replay = nullcontext()
            if routed is not None:
                routed = routed[:, :, self.first_layer:self.first_layer + replayer.layers]
                replay = replayer.forward(routed, real if count_routing else None)
            with replay, (hidden_for_output(unwrap(stage_model)) if self.is_last else nullcontext()) as head:
                output = stage_model(mb.input_ids, mb.position_ids, mb.attention_mask,
                                     packed_seq_params=mb.packed_seq_params)

            def loss_func(hidden):
                loss, value = on_output(mb, hidden, head["weight"])
                values.append(value)
                return loss, torch.zeros((), dtype=torch.int), {}
            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=model,
            num_microbatches=len(micro_batches), seq_length=1, micro_batch_size=1,  # shapes travel
            forward_only=forward_only)
        return values if self.is_last else None

    def share(self, per_sample: list, lengths: Sequence[int], device) -> list[np.ndarray]:
        """The last stage's per-sample arrays (``lengths[i]`` long each; None elsewhere) on every
        stage of the pipeline, as float32."""
        flat = np.concatenate([np.asarray(a, dtype=np.float64) for a in per_sample]) if self.is_last else None
        flat = self._from_last(flat, int(sum(lengths)), device)
        return [a.astype(np.float32) for a in np.split(flat, np.cumsum(lengths)[:-1])]

    def metric_sums(self, per_micro_batch: list[dict] | None, device) -> dict[str, float]:
        """The step's metric sums over the micro-batches (``*_max``: max) from the last stage's
        per-micro-batch dicts, on every stage of the pipeline (keys among `STEP_SUMS`)."""
        vector = None
        if self.is_last:
            unknown = set().union(*per_micro_batch) - set(STEP_SUMS)
            if unknown:
                raise ValueError(f"metric sums {sorted(unknown)} are not in STEP_SUMS")
            vector = np.zeros(2 * len(STEP_SUMS))
            for j, k in enumerate(STEP_SUMS):
                got = [m[k] for m in per_micro_batch if k in m]
                vector[j] = (max(got) if k.endswith("_max") else sum(got)) if got else 0.0
                vector[len(STEP_SUMS) + j] = float(bool(got))
        vector = self._from_last(vector, 2 * len(STEP_SUMS), device)
        return {k: float(vector[j]) for j, k in enumerate(STEP_SUMS) if vector[len(STEP_SUMS) + j]}

    def _from_last(self, flat: np.ndarray | None, size: int, device) -> np.ndarray:
        """The last stage's float64 vector ``flat`` (``size`` long) on every stage."""
        import torch

        t = torch.as_tensor(flat, dtype=torch.float64).to(device) if self.is_last else \
            torch.zeros(size, dtype=torch.float64, device=device)
        torch.distributed.broadcast(t, self.last_rank, group=self.group)
        return t.cpu().numpy()
