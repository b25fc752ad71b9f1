"""Trainer configuration (Hydra structured configs); light to import: no torch, no megatron."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelConfig:
    """Model-parallel layout of the trainer."""

    tp: int = 1  # tensor-parallel size
    ep: int = 1  # expert-parallel size (MoE only; carved out of data parallelism)
    pp: int = 1  # pipeline-parallel size (stages; megatron's 1F1B schedule)
    cp: int = 1  # context-parallel size (each sequence split over cp ranks)
    etp: int | None = None  # expert tensor-parallel size (MoE only); None: 1 when ep > 1, else tp (expert_tp)
    sequence_parallel: bool | None = None  # None: on when tp > 1 and the model is MoE
    moe_dispatcher: str = "alltoall"  # megatron token dispatcher; "allgather" only when tp*ep == 1
    params_dtype: str = "float32"  # "float32" or "bfloat16"
    grouped_experts: bool = True  # MoE: each layer's local experts as grouped matrix products (pipeline/trainer/grouped_experts.py); False: one expert after another

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect: ``etp`` when set; else 1 with expert
        parallelism (experts stay whole, as megatron advises for MoE) and ``tp`` without it
        (megatron-core 0.16.1 reduces expert gradients correctly only with etp = tp when ep = 1,
        `pipeline.trainer.model`). Example: tp 2, ep 2 -> 1; tp 2, ep 1 -> 2."""
        if self.etp is not None:
            return self.etp
        return 1 if self.ep > 1 else self.tp


@dataclass
class MoEConfig:
    """Router losses and expert capacity of an MoE model (ignored for dense models).

    Defaults suit RL fine-tuning of a pretrained MoE: no auxiliary losses (they add a gradient
    that is not the policy's, and megatron computes them per micro-batch, so their value would
    depend on the parallel layout) and no capacity limit (dropping tokens in the trainer that the
    generator did route recreates the train-inference mismatch routing replay removes).
    """

    load_balancing: str = "none"  # megatron's moe_router_load_balancing_type: "none", "aux_loss" (per micro-batch), "seq_aux_loss" (per sequence), "global_aux_loss"
    aux_loss_coef: float = 0.0  # weight of the load-balancing loss (needs load_balancing != "none")
    z_loss_coef: float = 0.0  # weight of the router z-loss (mean squared logsumexp of router logits; 0: off)
    capacity_factor: float | None = None  # expert capacity = factor * tokens * top-k / experts; None: no limit, no drops
    drop_policy: str = "probs"  # with a capacity: drop the lowest-probability ("probs") or latest ("position") tokens


@dataclass
class LossConfig:
    """Hyper-parameters of the policy loss."""

    clip_eps_low: float = 0.2  # PPO clip range below 1 (ratio >= 1 - eps_low)
    clip_eps_high: float = 0.2  # PPO clip range above 1 (ratio <= 1 + eps_high; 0.28 = DAPO's clip-higher)
    tis_cap: float = 2.0  # cap of the truncated importance weight proximal/behaviour (token_tis, seq_tis)
    correction: str = "token_tis"  # importance-correction preset (pipeline/trainer/corrections.py, docs/corrections.md)
    is_low: float | None = None  # lower bound of the weight band of masking presets (None: the preset's)
    is_high: float | None = None  # upper bound of the weight band of masking presets (None: the preset's)
    kl_coef: float = 0.0  # weight of the k3 KL estimate to the reference policy (0: off)
    pg_coef: float = 1.0  # weight of the policy-gradient (PPO-clip) term; 0 with distill_coef > 0: distillation alone
    distill_coef: float = 0.0  # weight of the reverse KL to the teacher (needs teacher_logprobs: scorers.teacher; loss.py, docs/scorers.md)
    token_reward_coef: float = 0.0  # c in the per-token advantage A + c * (reward-to-go of token_rewards) (0: off; needs token_rewards; loss.py)
    aggregation: str = "token"  # "token" (global token mean) or "sequence" (mean of row means)
    advantage_std_norm: bool = True  # GRPO: divide by the group's reward std (Dr. GRPO: False)


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, ``docs/lora.md``): train ``W + (alpha/rank) B A`` with ``W`` frozen.

    Targets are regular expressions searched in the megatron module names of the adaptable linear
    layers: ``...self_attention.linear_qkv`` (HF q/k/v_proj), ``...self_attention.linear_proj``
    (o_proj), ``...mlp.linear_fc1`` (gate/up_proj), ``...mlp.linear_fc2`` (down_proj) and each
    expert's ``...mlp.experts.local_experts.J.linear_fc1`` / ``linear_fc2``. Every pattern must
    match at least one of them.
    """

    rank: int = 0  # adapter rank r (0: LoRA off, full-weight training)
    alpha: float = 16.0  # scale numerator: the update is (alpha / rank) * B @ A
    dropout: float = 0.0  # dropout on the adapter's input (training only; needs tp == 1 when > 0)
    targets: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])  # regexes over module names (default: attention, dense MLP and every expert's MLP)


@dataclass
class TrainerConfig:
    """Trainer hyper-parameters and layout."""

    model_dir: str = ""  # HF checkpoint directory to start from
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # TP / EP / ETP / PP layout
    moe: MoEConfig = field(default_factory=MoEConfig)  # router losses, expert capacity
    loss: LossConfig = field(default_factory=LossConfig)  # policy-loss hyper-parameters
    lora: LoraConfig = field(default_factory=LoraConfig)  # low-rank adapters (rank 0: off)
    lr: float = 1e-6  # learning rate (constant)
    weight_decay: float = 0.0  # AdamW weight decay
    adam_betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    adam_eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: off)
    micro_batch_tokens: int = 4096  # tokens per training micro-batch (padding included)
    no_grad_micro_batch_tokens: int | None = None  # tokens per micro-batch of the no-grad passes (old-policy, reference logprobs); None: 4 x micro_batch_tokens
    logprob_chunk_tokens: int = 1024  # tokens whose fp32 logits exist at once (logprobs and entropy, logprobs.py)
    recompute: str = "none"  # activation recomputation (megatron's): "none", "selective" (core attention), "full" (every layer; not with routing_replay)
    layout: str = "packed"  # "packed": sequences concatenated (THD) with per-sequence attention; "padded": rows right-padded (layout.py)
    mini_batches: int = 1  # optimizer steps per train_step (each on a slice of the samples)
    recompute_proximal: bool = False  # decoupled PPO: recompute old-policy logprobs before the update
    routing_replay: bool = False  # Keep Routing: replay samples' recorded MoE routing (routing_replay.py)
    temperature: float = 1.0  # sampling temperature the generator used (logits are divided by it)
    seed: int = 1234  # seed of model-parallel RNG states
    optimizer: str = "auto"  # "torch" (AdamW, CPU) | "megatron" (distributed, CUDA) | "auto"
    overlap_grad_reduce: bool = True  # start each gradient bucket's DP reduction during the last micro-batch's backward (megatron DDP; optimizer.py)
    overlap_param_gather: bool = False  # optimizer="megatron": gather updated parameter shards during the next forward instead of after the step (optimizer.py: off, weight sync and checkpoints read parameters before that forward)
    optimizer_offload_fraction: float = 0.0  # optimizer="megatron": fraction of its state (fp32 masters, Adam moments) and update kept on the host (megatron's HybridDeviceOptimizer; 0: all on the GPU)
    timeout_s: float = 600.0  # timeout of every collective
    export: str = "end"  # Hugging Face export to RUN/export/step-K: "end" (of the run), "checkpoints" (every checkpoint too), "never"
