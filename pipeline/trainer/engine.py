"""The trainer engine: megatron-core model + loss + optimizer, one instance per rank.

Invariants:
- Every rank of the world constructs a ``Trainer`` and calls the same methods in the same order
  (they are collectives). ``samples`` passed to ``logprobs``/``train_step`` are the samples of
  this rank's data-parallel rank; TP ranks of one DP rank receive the same list.
- Gradients are the gradient of ONE loss for the whole global batch: each token's loss is divided
  by the global token count (all-reduced over DP before the first micro-batch), megatron DDP sums
  gradients over DP (``calculate_per_token_loss=True``), so any DP/TP/EP layout and any
  micro-batch split give the same update (up to float rounding).
- Ranks run the same number of micro-batches (padded with token-free dummies) because MoE
  expert-parallel dispatch is a collective in every forward.
- Context parallelism: the ranks of a CP group hold the same samples and micro-batches; each
  feeds the model its share of every sequence and gathers the per-token logprobs back
  (`context_parallel`), so loss and metrics are one rank's; DDP sums gradients over DP x CP.
- Checkpoints (``save``/``load``, see ``checkpoint``) hold weights and Adam moments in Hugging
  Face names and shapes; they restore exactly on any TP/EP/DP layout of the same model.
- With ``trainer.lora.rank > 0`` (``lora``) the base weights are frozen: only the adapters are in
  the optimizer, its state, the gradient norm, checkpoints and weight syncs.
"""
from __future__ import annotations

import datetime
import os
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from .layout import TrainSample, make_layout
from .config import TrainerConfig
from .corrections import check_trainer_config
from .logprobs import hidden_for_output, token_logprobs
from .loss import group_advantages, policy_loss, reward_to_go, token_advantages
from .optimizer import apply_update, make_optimizer, wrap_ddp
from .routing_replay import RoutingReplay, attach_routing
from .sampling_mask import attach_kept_ids


class Trainer:
    def __init__(self, cfg: TrainerConfig, rank: int | None = None, world_size: int | None = None,
                 init_method: str | None = None, store: "torch.distributed.Store | None" = None):
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from megatron_patches import apply_patches

        from .model import build_gpt_model, load_hf_config, load_hf_weights, spec_norm, uses_sequence_parallel

        check_trainer_config(cfg)
        self.cfg = cfg
        self.cuda = torch.cuda.is_available()
        self.hf_config = load_hf_config(cfg.model_dir)
        apply_patches("cuda" if self.cuda else "cpu",
                      sequence_parallel=uses_sequence_parallel(self.hf_config, cfg.parallel),
                      norm=spec_norm(self.hf_config))
        if not torch.distributed.is_initialized():
            rank = int(os.environ.get("RANK", 0)) if rank is None else rank
            world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
            if self.cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
            torch.distributed.init_process_group(
                "nccl" if self.cuda else "gloo", init_method=None if store is not None else init_method or "env://",
                store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=cfg.timeout_s))
        # this rank's device, read before any other thread exists; weight channels get it explicitly
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        p = cfg.parallel
        if cfg.lora.rank and p.pp > 1:
            raise ValueError("trainer.lora.rank > 0 with trainer.parallel.pp > 1 is not supported")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tp, expert_model_parallel_size=p.ep,
            pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp,
            expert_tensor_parallel_size=p.expert_tp,
            distributed_timeout_minutes=max(1, int(cfg.timeout_s // 60)))
        model_parallel_cuda_manual_seed(cfg.seed)
        if cfg.recompute == "full" and cfg.routing_replay:
            raise ValueError("trainer.recompute=full with trainer.routing_replay: megatron recomputes the "
                             "routers in backward, after the replayed routing is cleared; use 'selective'")
        model = build_gpt_model(self.hf_config, p, cfg.moe, cfg.recompute)
        load_hf_weights(model, self.hf_config, cfg.model_dir)
        self.lora = None
        if cfg.lora.rank:
            from .lora import attach_lora

            self.lora = attach_lora(model, cfg.lora, p, self.hf_config, cfg.seed)
        self.replayer = None  # compares recorded routing with the router's (replays it with routing_replay)
        if cfg.routing_replay or model.config.num_moe_experts:
            self.replayer = RoutingReplay(model, cfg.routing_replay, ps.get_tensor_model_parallel_rank(),
                                          p.tp, model.config.sequence_parallel,
                                          ps.get_pipeline_model_parallel_group() if p.pp > 1 else None)
        self.optimizer_kind = cfg.optimizer if cfg.optimizer != "auto" else (
            "megatron" if self.cuda else "torch")
        self.model = wrap_ddp(model, cfg, self.optimizer_kind)
        # masters: fp32 master weights of a bf16 model on the torch path (masters.py), else None
        self.optimizer, self.masters = make_optimizer(cfg, self.optimizer_kind, self.model, self.trainable(),
                                                      self.cuda)
        self.ref_model = None
        if cfg.loss.kl_coef:
            self.ref_model = build_gpt_model(self.hf_config, p, cfg.moe)
            load_hf_weights(self.ref_model, self.hf_config, cfg.model_dir)
            self.ref_model.requires_grad_(False)
        sp = self.model.module.config.sequence_parallel
        self.routing = None
        if self.model.module.config.num_moe_experts:
            from .routing_stats import RoutingStats

            self.routing = RoutingStats(self.model, sp)
        split = 2 * p.cp if p.cp > 1 else 1  # context parallelism: every segment cut into 2 cp chunks
        self.layout = make_layout(cfg.layout, cfg.micro_batch_tokens, pad_multiple=(p.tp if sp else 1) * split,
                                  device="cuda" if self.cuda else "cpu", segment_multiple=split)
        self.context = None  # this rank's share of each sequence (context_parallel.py; None: no CP)
        if p.cp > 1:
            from .context_parallel import ContextParallel

            self.context = ContextParallel()
        self.dp_group = ps.get_data_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.stages = None  # this rank's pipeline stage (pipeline_stages.py; None: no PP)
        if p.pp > 1:
            from .pipeline_stages import PipelineSchedule

            self.stages = PipelineSchedule(self.model)
        self.steps = 0
        from pipeline.weights.shards import ShardedWeights

        from .lora import trainable_parameters

        self.trainable_params = trainable_parameters(self.model, self.hf_config)
        self.sync_bytes = ShardedWeights(self.model, self.hf_config).total_bytes  # what one weight sync moves

    # ---------------------------------------------------------------- construction helpers
    def trainable(self) -> list:
        """The parameters the optimizer updates (a LoRA model: its adapters only)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    # ---------------------------------------------------------------- collectives
    def _all_reduce(self, values, group, op=None):
        import torch

        t = torch.as_tensor(values, dtype=torch.float64, device=self.layout.device).clone()
        torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM, group=group)
        return t

    def _equalised(self, micro_batches):
        """Pad the micro-batch list with dummies to the maximum count over the world."""
        import torch

        most = int(self._all_reduce([len(micro_batches)], None, torch.distributed.ReduceOp.MAX)[0])
        return micro_batches + [self.layout.dummy() for _ in range(most - len(micro_batches))]

    def _attach(self, samples, budget=None):
        """The layout's micro-batches (of at most ``budget`` tokens) with recorded sampling masks
        and (routing replay) routing."""
        mbs = attach_kept_ids(self.layout.micro_batches(samples, budget), samples, self.layout.device)
        return attach_routing(mbs, samples, self.layout.device) if self.replayer is not None else mbs

    # ---------------------------------------------------------------- forward
    def _token_logprobs(self, model, mb, want_entropy=False, count_routing=False):
        """``[rows, S]`` logprobs of the labels (and entropies, no grad) under ``model``, chunked
        over tokens (`logprobs`); with ``count_routing`` the recorded-vs-own routing differences
        are counted."""
        from .conversion import unwrap

        fed = mb if self.context is None else self.context.local(mb)  # CP: this rank's share
        routed = fed.extras.get("routed_experts") if model is self.model else None
        with self.replayer.forward(routed, fed.real_mask() if count_routing else None) if routed is not None \
                else nullcontext(), hidden_for_output(unwrap(model)) as output:
            hidden = model(fed.input_ids, fed.position_ids, fed.attention_mask,
                           packed_seq_params=fed.packed_seq_params)
        values = self._output_logprobs(hidden, output["weight"], fed, want_entropy)
        return values if self.context is None else tuple(self.context.gather(mb, v) for v in values)

    def _output_logprobs(self, hidden, weight, mb, want_entropy=False):
        """``[rows, S]`` logprobs of the labels (and entropies, no grad) from the final hidden
        states and this rank's output-weight shard (the last pipeline stage's, under PP)."""
        return token_logprobs(hidden, weight, mb.labels, mb.extras.get("kept_ids"), self.cfg.temperature,
                              self.tp_group, self.cfg.logprob_chunk_tokens, want_entropy)

    def logprobs(self, samples: Sequence[TrainSample], reference: bool = False,
                 count_routing: bool = False) -> list[np.ndarray]:
        """Per-completion-token logprobs of ``samples`` under the current (or reference) policy;
        ``count_routing``: count own-vs-recorded routing differences (`routing_differences`)."""
        import torch

        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("no reference model: set loss.kl_coef > 0 to build one")
        out: list[np.ndarray | None] = [None] * len(samples)
        model.eval()
        with torch.no_grad():
            budget = self.cfg.no_grad_micro_batch_tokens or 4 * self.cfg.micro_batch_tokens
            micro_batches = self._equalised(self._attach(samples, budget))
            staged = self.stages.run(model, micro_batches, lambda mb, hidden, weight: (
                hidden.new_zeros(()), self._output_logprobs(hidden, weight, mb)[0]), True,
                self.replayer if model is self.model else None, count_routing) if self.stages is not None else None
            for k, mb in enumerate(micro_batches):
                if self.stages is None:
                    values, _ = self._token_logprobs(model, mb, count_routing=count_routing)
                elif self.stages.is_last:
                    values = staged[k]
                else:
                    continue  # not the last stage: the last one shares its logprobs below
                real = [i for i in mb.sample_index if i >= 0]
                for i, arr in zip(real, self.layout.gather(mb, values)):
                    out[i] = arr
        model.train()
        if self.stages is None:
            return out
        return self.stages.share(out, [len(s.completion_ids) for s in samples], self.layout.device)

    def routing_differences(self) -> dict[str, float]:
        """``routing_differ_frac`` / ``routing_differ_token_frac`` counted since the last call (a
        collective; {} for a dense model or when no counted forward carried routing)."""
        return self.replayer.collect(self._all_reduce) if self.replayer is not None else {}

    # ---------------------------------------------------------------- training
    def _with_advantages(self, samples) -> list[TrainSample]:
        """Copies of ``samples`` where a missing advantage is the GRPO advantage over the GLOBAL
        batch's groups (rewards and group ids are all-gathered over DP); inputs are not changed."""
        import torch

        missing = [s.advantage is None for s in samples]
        if self._all_reduce([sum(missing)], None)[0] == 0:
            return list(samples)
        dp = torch.distributed.get_world_size(self.dp_group)
        longest = int(self._all_reduce([len(samples)], self.dp_group, torch.distributed.ReduceOp.MAX)[0])
        mine = torch.full((longest, 3), float("nan"), dtype=torch.float64)
        for i, s in enumerate(samples):
            mine[i] = torch.tensor([s.reward, s.group_id, float(missing[i])])
        mine = mine.to(self.layout.device)
        gathered = [torch.empty_like(mine) for _ in range(dp)]
        torch.distributed.all_gather(gathered, mine, group=self.dp_group)
        table = torch.cat([g.cpu() for g in gathered])
        offset = torch.distributed.get_rank(self.dp_group) * longest
        valid = ~torch.isnan(table[:, 0]) & (table[:, 2] == 1.0)
        adv = torch.full((len(table),), float("nan"), dtype=torch.float32)
        adv[valid] = group_advantages(table[valid, 0], table[valid, 1].long(),
                                      std_norm=self.cfg.loss.advantage_std_norm)
        return [replace(s, advantage=float(adv[offset + i])) if missing[i] else s
                for i, s in enumerate(samples)]

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One update (``mini_batches`` optimizer steps) on this DP rank's samples; metrics are
        global (identical on every rank)."""
        start = time.perf_counter()
        samples = self._with_advantages(samples)
        if self.cfg.recompute_proximal:
            proximal = self.logprobs(samples)
        ref = self.logprobs(samples, reference=True) if self.ref_model is not None else None
        chunks = np.array_split(np.arange(len(samples)), self.cfg.mini_batches)
        totals: dict[str, float] = {}
        for chunk in chunks:
            part = [samples[i] for i in chunk]
            extra = {}
            if self.cfg.recompute_proximal:
                extra["proximal"] = [proximal[i] for i in chunk]
            if ref is not None:
                extra["ref"] = [ref[i] for i in chunk]
            if self.cfg.loss.distill_coef:
                extra["teacher"] = [_teacher_logprobs(samples[i]) for i in chunk]
            if self.cfg.loss.token_reward_coef:
                extra["token_returns"] = [_token_returns(samples[i]) for i in chunk]
            for k, v in self._optimizer_step(part, extra).items():  # tokens: sum, *_max: max, others: mean
                totals[k] = max(totals.get(k, 0.0), v) if k.endswith("_max") else \
                    totals.get(k, 0.0) + (v if k == "tokens" else v / len(chunks))
        if self.routing is not None:
            totals.update(self.routing.collect(self._all_reduce, self.cfg.parallel.tp))
        totals.update(self.routing_differences())
        self.steps += 1
        totals["trainable_params"] = float(self.trainable_params)
        totals["sync_bytes"] = float(self.sync_bytes)
        totals["step_time_s"] = time.perf_counter() - start
        totals["tokens_per_s"] = totals["tokens"] / totals["step_time_s"]
        return totals

    def _optimizer_step(self, samples, extra) -> dict[str, float]:
        import torch
        from megatron.core.distributed import finalize_model_grads

        cfg = self.cfg
        micro_batches = self._equalised(self._attach(samples))
        local_rows = len(samples)
        local_tokens = sum(int(s.trained.sum()) for s in samples)
        tokens, rows = self._all_reduce([local_tokens, local_rows], self.dp_group).tolist()
        if tokens == 0:
            raise ValueError("the global batch has no completion tokens")
        normaliser = tokens if cfg.loss.aggregation == "token" else rows
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        per_sample = self.layout.completions  # [placed samples, completion]: the loss's shape

        def micro_batch_loss(mb, logp, entropy):
            scattered = {k: per_sample(mb, self.layout.scatter(mb, v)) for k, v in extra.items()}
            loss, m = policy_loss(
                per_sample(mb, logp), per_sample(mb, mb.extras["behaviour"]),
                token_advantages(mb.extras["advantage"], scattered.get("token_returns"),
                                 cfg.loss.token_reward_coef),
                per_sample(mb, mb.loss_mask), normaliser, cfg.loss,
                proximal_logprobs=scattered.get("proximal"), ref_logprobs=scattered.get("ref"),
                teacher_logprobs=scattered.get("teacher"))
            m.update(loss=loss.detach(), entropy=(entropy * mb.loss_mask).sum())
            return loss, {k: float(v) for k, v in m.items()}

        if self.stages is not None:
            sums = self.stages.metric_sums(self.stages.run(
                self.model, micro_batches, lambda mb, hidden, weight: micro_batch_loss(
                    mb, *self._output_logprobs(hidden, weight, mb, want_entropy=True)),
                False, self.replayer, True, self.routing), self.layout.device)
        for k, mb in enumerate(micro_batches if self.stages is None else ()):
            if self.routing is not None:
                self.routing.track((mb if self.context is None else self.context.local(mb)).real_mask())
            # overlap_grad_reduce: buckets start reducing in the last micro-batch's backward (optimizer.py)
            with self.model.no_sync() if k < len(micro_batches) - 1 else nullcontext():
                loss, m = micro_batch_loss(mb, *self._token_logprobs(self.model, mb, want_entropy=True,
                                                                     count_routing=True))
                loss.backward()
            for k, v in m.items():
                sums[k] = max(sums.get(k, 0.0), v) if k.endswith("_max") else sums.get(k, 0.0) + v
        if self.routing is not None:
            self.routing.track(None)
        finalize_model_grads([self.model])
        grad_norm = apply_update(self)
        keys = sorted(sums)
        maxed = self._all_reduce([sums[k] for k in keys], self.dp_group, torch.distributed.ReduceOp.MAX)
        summed = self._all_reduce([sums[k] for k in keys], self.dp_group)
        g = {k: float(maxed[i] if k.endswith("_max") else summed[i]) for i, k in enumerate(keys)}
        tok = g["tokens"]
        return {"loss": g["loss"], "clip_fraction": g["clipped"] / tok, "tis_clip_fraction": g["is_truncated"] / tok,
                "is_mask_fraction": g["is_masked"] / tok, "is_weight_mean": g["is_weight"] / tok,
                "is_weight_max": g["is_weight_max"], "kl": g["kl"] / tok, "ratio_mean": g["ratio"] / tok,
                "entropy": g["entropy"] / tok, "grad_norm": grad_norm, "tokens": tok,
                **({"teacher_kl": g["teacher_kl"] / tok} if "teacher_kl" in g else {})}

    # ---------------------------------------------------------------- export / checkpoints
    def export_hf(self, out_dir: str | Path) -> Path | None:
        """Write a Hugging Face directory of the current weights (collective; each rank writes
        the tensors it owns). Returns the directory on world rank 0, None elsewhere."""
        from .export import export_live

        return export_live(self, Path(out_dir))

    def save(self, directory: str | Path) -> None:
        from .checkpoint import save_checkpoint

        save_checkpoint(self, Path(directory))

    def load(self, directory: str | Path) -> None:
        from .checkpoint import load_checkpoint

        load_checkpoint(self, Path(directory))

    def close(self) -> None:
        import torch
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _teacher_logprobs(sample: TrainSample) -> np.ndarray:
    if sample.teacher_logprobs is None:
        raise ValueError("trainer.loss.distill_coef is set but a sample has no teacher logprobs "
                         "(scorers.teacher must be set: docs/scorers.md)")
    return sample.teacher_logprobs


def _token_returns(sample: TrainSample) -> np.ndarray:
    if sample.token_rewards is None:
        raise ValueError("trainer.loss.token_reward_coef is set but a sample has no token rewards "
                         "(scorers.reward=process_reward, or an environment with step rewards)")
    return reward_to_go(sample.token_rewards)
