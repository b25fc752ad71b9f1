"""Per-rank memory of a trainer layout: what the state holds, what a step adds, the peak.

`rank_memory(shape, layout)` returns a `MemoryPlan`: bytes per component on the worst pipeline
stage, the peak, and the pipeline bubble. Components (all per rank):

- ``parameters``: dense parameters / tp (embeddings and output layer on the first and last stage),
  expert parameters / (ep * etp), layers / pp; in ``params_dtype``;
- ``gradients``: megatron DDP's fp32 buffer (``grad_reduce_in_fp32``), one fp32 value per parameter;
- ``optimizer``: Adam's two fp32 moments, plus fp32 masters when parameters are bf16. The
  distributed optimizer (``megatron``) shards dense state over DP = world / (tp * pp * cp) and
  expert state over expert-DP = world / (ep * etp * pp) (megatron derives expert-DP the same way);
  ``offload`` moves that fraction of it to host memory. The torch path (CPU) keeps all of it, and
  with bf16 parameters the masters' fp32 gradients too;
- ``reference``: the KL reference model, built with the policy's layout (same shards), no grads;
- ``activations``: tensors saved for backward, counted per token and layer by module as the
  trainer's saved-tensor hooks show them (`activation_elements`) times the layers of a stage, the
  tokens of a micro-batch and the micro-batches in flight (1F1B: ``pp - stage``); the last stage
  adds the final norm's input and output and the hidden states the chunked log-probabilities keep
  (4 h per token). Routed experts (`GroupedExperts`) save each routed row's input and its fc1 /
  SwiGLU outputs; in fp32 (the CPU path) the rows sit in a zero-padded ``[E, max_j rows, .]``
  block (``expert_block_padding``: block rows over routed rows), in bf16 (grouped GEMM on GPU)
  they do not; each MoE layer also saves its stacked expert weights. Context parallelism
  (``cp``, packed only: `pipeline.trainer.context_parallel`) divides the tokens of a rank by cp,
  except the attention kernel's tensors: K/V are all-gathered whole and rank 0's query block
  spans the whole row, so the kernel's q, K/V, output and log-sum-exp count cp times per local
  token (``kv_gather``: the bytes a rank receives per layer and micro-batch). Megatron's local
  attention (``attention="local"``; no trainer layout uses it any more) saves its ``S x S``
  probabilities per head; ``recompute="full"`` keeps only each
  layer's input, ``"selective"`` drops the attention probabilities;
- ``attention``: megatron's local attention (``"local"``): its persistent
  ``[rows*heads/tp, S, S]`` score buffer and causal mask, plus the transient copies of one layer's
  scores while it runs; the trainer's per-sequence attention (``"flash"``, both layouts) holds none;
- ``logits``: one chunk of the chunked fused log-probabilities (`pipeline.trainer.logprobs`; the
  trainer has no unchunked path): ``[chunk, V/tp]`` fp32 logits and their softmax / gradient
  (8 B) plus the kept-set mask (1 B) per vocabulary entry, in backward.

The peak is the state plus the step's largest moment (forward/backward, or the optimizer's
temporaries). Calibration (`CALIBRATION`) holds what the shapes do not give: the expert block's
padding and the local attention's score copies, measured on one-rank CPU steps (`TensorMemory`);
the checks run on other layouts (tests/plan/test_planner_peaks.py,
bench/results/2026-12-06-plan.md).

Worked example (tiny dense of tests, fp32, tp 1, packed, one 512-token row; h 256, 4 query / 2 KV
heads of 64, ffn 512, V 512, 2 layers): 1.44 M parameters, state = 16 B x 1.44 M = 23.1 MB; per
token and layer the attention saves 3076 and the MLP 3328 elements (25.6 KB), so the activations
are 2 x 512 x 25.6 KB + 4 h x 4 B x 512 = 28.3 MB; the logits chunk 9 B x 512 x 512 = 2.4 MB:
predicted peak 53.8 MB (measured 54.7 MB).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.plan.shape import ModelShape

#: Measured on one-rank CPU steps (tests/support/peak_probe.py, bench/results/2026-12-06-plan.md):
#: the fp32 expert block's rows over the routed rows (the busiest expert's load over the mean, tiny
#: MoE at 512 tokens), and the copies of one layer's scores that exist at once beside the saved
#: probabilities in megatron's local attention.
CALIBRATION = {"expert_block_padding": 1.8, "score_copies": 0.4}
GiB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Layout:
    """A trainer layout and what one micro-batch holds."""

    world: int = 1  # ranks (GPUs) of the trainer
    tp: int = 1  # tensor-parallel size
    ep: int = 1  # expert-parallel size
    etp: int = 1  # expert tensor-parallel size
    pp: int = 1  # pipeline stages
    cp: int = 1  # context-parallel size
    micro_batch_tokens: int = 4096  # padded tokens per micro-batch (whole rows of seq_len; at least one)
    seq_len: int = 4096  # padded length of one row (attention's S)
    micro_batches: int = 1  # micro-batches per optimizer step (the pipeline's m)
    params_dtype: str = "bfloat16"  # "float32" or "bfloat16"
    optimizer: str = "megatron"  # "megatron" (distributed, sharded over DP) or "torch"
    offload: float = 0.0  # fraction of the optimizer state in host memory (megatron's HybridDeviceOptimizer)
    recompute: str = "none"  # "none", "selective" (attention) or "full" (every layer)
    logits_chunk: int = 1024  # tokens whose fp32 logits exist at once (trainer.logprob_chunk_tokens)
    attention: str = "flash"  # "flash" (the trainer's per-sequence attention, both layouts: no S x S tensor) or "local" (megatron's own S x S scores)
    reference: bool = False  # a KL reference model is held

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.ep * self.etp * self.pp)

    def check(self, shape: ModelShape) -> None:
        """Raise ValueError naming what does not divide."""
        if self.world % (self.tp * self.pp * self.cp):
            raise ValueError(f"world {self.world} is not a multiple of tp*pp*cp = {self.tp * self.pp * self.cp}")
        if self.world % (self.ep * self.etp * self.pp):
            raise ValueError(f"world {self.world} is not a multiple of ep*etp*pp = {self.ep * self.etp * self.pp}")
        if shape.layers % self.pp:
            raise ValueError(f"{shape.layers} layers do not split into pp={self.pp} stages")
        if shape.heads % self.tp or shape.kv_heads % self.tp and self.tp % shape.kv_heads:
            raise ValueError(f"{shape.heads} query / {shape.kv_heads} KV heads do not split over tp={self.tp}")
        if shape.is_moe and shape.experts % self.ep:
            raise ValueError(f"{shape.experts} experts do not split over ep={self.ep}")
        if not shape.is_moe and (self.ep, self.etp) != (1, 1):
            raise ValueError("ep/etp > 1 need an MoE model")
        if self.seq_len % self.cp:
            raise ValueError(f"seq_len {self.seq_len} does not split over cp={self.cp}")
        for name, value, allowed in (("params_dtype", self.params_dtype, DTYPE_BYTES),
                                     ("optimizer", self.optimizer, ("megatron", "torch")),
                                     ("recompute", self.recompute, ("none", "selective", "full")),
                                     ("attention", self.attention, ("local", "flash"))):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}")


@dataclass
class MemoryPlan:
    """Bytes per component on the worst stage, the peak, and what binds."""

    layout: Layout
    components: dict[str, float] = field(default_factory=dict)  # name -> bytes (worst stage)
    peak: float = 0.0  # state + the step's largest moment, bytes
    stage: int = 0  # the pipeline stage with the peak
    bubble: float = 0.0  # 1F1B idle fraction (pp - 1) / (m + pp - 1)
    kv_gather: float = 0.0  # context parallelism: bytes a rank receives per layer and micro-batch (K/V all-gather; backward all-reduces twice that)
    activations_per_token: dict[str, float] = field(default_factory=dict)  # bytes per token and layer, by layer part

    def binding(self) -> str:
        """The largest component's name."""
        return max(self.components, key=self.components.get)


def activation_elements(shape: ModelShape, layout: Layout, tokens_per_row: int) -> dict[str, float]:
    """Elements saved for backward per token and layer, by part, on one rank (tp shards heads and
    MLP widths; the ``h``-wide tensors are whole on each rank without sequence parallelism)."""
    tp, h, d, qkn = layout.tp, shape.hidden, shape.head_dim, shape.qk_norm
    q, kv = shape.heads / tp, max(shape.kv_heads / tp, 1)
    lse = q * 4 / DTYPE_BYTES[layout.params_dtype]  # the kernel's fp32 log-sum-exp per query head
    # norm input and output, QKV linear's input; QKV out; QK-norm in/out (q) and out (k); rotated q;
    # the kernel's contiguous q and k/v and its output; the output projection's input
    kernel = (2 * q + kv) * d + (lse if layout.attention == "flash" else 0.0)
    if layout.cp > 1:  # context parallelism (packed): K/V gathered whole, rank 0's query block spans the row
        kernel = (kernel + 2 * kv * d) * layout.cp
    attention = 3 * h + (q + 2 * kv) * d + (2 * q + kv) * d * qkn + q * d + kernel + q * d
    scores = q * tokens_per_row if layout.attention == "local" and layout.recompute == "none" else 0.0
    if shape.is_moe:  # norm in/out, router input, router logits/probs; per routed row: input, fc1 out [gate; up], silu, product, x prob
        padding = CALIBRATION["expert_block_padding"] if layout.params_dtype == "float32" else 1.0
        mlp = 3 * h + 2 * shape.experts + shape.top_k * padding * (h + 5 * shape.expert_ffn / layout.etp)
    else:  # norm in/out, fc1 input, fc1 out [gate; up], silu(gate), product, fc2 input
        mlp = 3 * h + 5 * shape.ffn / tp
    return {"attention": attention, "scores": scores, "mlp": mlp}


def rank_memory(shape: ModelShape, layout: Layout) -> MemoryPlan:
    """The per-rank memory of ``layout`` (see the module docstring)."""
    layout.check(shape)
    L = layout
    pbytes, abytes = DTYPE_BYTES[L.params_dtype], DTYPE_BYTES[L.params_dtype]
    layers = shape.layers // L.pp
    dense_layer = (shape.n_attention + shape.n_dense_mlp) / L.tp + shape.n_router + 2 * shape.hidden
    expert_layer = shape.n_expert_layer / (L.ep * L.etp)
    rows = max(1, L.micro_batch_tokens // L.seq_len)
    tokens = rows * L.seq_len // L.cp
    s_local = L.seq_len // L.cp
    parts = activation_elements(shape, L, L.seq_len)
    per_token_layer = abytes * sum(parts.values())
    if L.recompute == "full":
        per_token_layer = abytes * shape.hidden
    best: MemoryPlan | None = None
    for stage in range(L.pp):
        first, last = stage == 0, stage == L.pp - 1
        embed = shape.vocab * shape.hidden / L.tp * (first + (last and not shape.tied))
        dense = layers * dense_layer + embed + (shape.hidden if last else 0)
        expert = layers * expert_layer
        n = dense + expert
        sharded = dense / L.dp + expert / L.expert_dp if L.optimizer == "megatron" else n
        masters = 4 * sharded if L.params_dtype == "bfloat16" else 0.0
        optimizer = (8 * sharded + masters) * (1 - L.offload)
        if L.optimizer == "torch" and L.params_dtype == "bfloat16":
            optimizer += 4 * n  # the masters' fp32 gradients, kept between steps
        in_flight = L.pp - stage
        heads = shape.heads / L.tp
        score_buffer = rows * heads * s_local * L.seq_len * abytes + rows * L.seq_len ** 2 / L.cp \
            if L.attention == "local" else 0.0
        activations = per_token_layer * layers * tokens * in_flight
        if L.recompute == "full":  # one layer re-run at a time during backward
            activations += abytes * sum(parts.values()) * tokens
        # the stacked expert weights each MoE layer saves, and their gradient in backward
        stacked_layers = (1 if L.recompute == "full" else layers * in_flight) + 1 if shape.is_moe else 0
        activations += abytes * expert_layer * stacked_layers
        if last:  # final norm input/output, the hidden states kept for the chunked log-probabilities
            activations += abytes * 4 * shape.hidden * tokens
        transient_scores = CALIBRATION["score_copies"] * score_buffer
        logits = (2 * 4 + 1) * min(tokens, L.logits_chunk) * shape.vocab / L.tp if last else 0.0
        comp = {"parameters": pbytes * n, "gradients": 4 * n, "optimizer": optimizer,
                "reference": pbytes * n if L.reference else 0.0, "activations": activations,
                "attention": score_buffer + transient_scores, "logits": logits}
        state = comp["parameters"] + comp["gradients"] + optimizer + comp["reference"]
        optimizer_step = 4 * sharded * (1 - L.offload)  # one fp32 temporary over the local state
        peak = state + max(activations + score_buffer + transient_scores + logits, optimizer_step)
        if best is None or peak > best.peak:
            best = MemoryPlan(L, comp, peak, stage)
    best.bubble = (L.pp - 1) / (L.micro_batches + L.pp - 1)
    best.kv_gather = (L.cp - 1) * tokens * 2 * max(shape.kv_heads / L.tp, 1) * shape.head_dim * abytes
    best.activations_per_token = {k: v * abytes for k, v in parts.items()}
    return best
