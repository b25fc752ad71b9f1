"""Generator configuration and the per-request inputs of the driver (light: no torch or vLLM imports).

Invariants:
- A request's sampling seed is a pure function of (run seed, group, sample, attempt, segment):
  `request_seed` hashes them with BLAKE2b into [0, 2**31). The same group re-issued as a new attempt
  samples differently; an abort-resumed sample's continuation (segment 1, 2, ...) gets its own seed,
  so a synchronous run that aborts at the same points reproduces exactly.
  Example: ``request_seed(0, 5, 1, 0) == request_seed(0, 5, 1, 0) != request_seed(0, 5, 1, 1)``.
- Prompts are token ids (`docs/architecture.md`, "Contracts"): the driver never tokenizes.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Sequence

INTERRUPT_MODES = ("keep", "keep_kv", "drain", "abort")
WEIGHT_SYNC_MODES = ("auto", "staged", "streamed")
WEIGHT_CHANNELS = ("broadcast", "cuda_ipc")


@dataclass
class GeneratorConfig:
    """One generator (a vLLM engine plus its driver)."""

    model: str = ""
    """Hugging Face checkpoint directory (weights, config and tokenizer) the engine starts from."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens (None: from the model and task, pipeline.models.defaults)."""
    max_tokens: int | None = None
    """Completion token budget per sample (None: the task's, task.max_tokens)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer must use the same one)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = 0
    """Top-k sampling; 0 disables it."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a completion besides the model's EOS (kept in the completion)."""
    ignore_eos: bool = False
    """Generate exactly max_tokens, ignoring EOS and stop tokens (benchmarks and tests of long outputs)."""
    logprobs_mode: str = "processed_logprobs"
    """vLLM logprobs mode of the behaviour logprobs: 'processed_logprobs' are after temperature and
    top-k/top-p (the distribution actually sampled), 'raw_logprobs' before them."""
    kv_cache_gib: int | None = None
    """KV cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE; None: sized for max_num_seqs sequences of
    max_model_len tokens); on GPU see gpu_memory_utilization."""
    sampling_mask_width: int = 0
    """Keep Sampling Mask: record per generated token the ids top-k/top-p sampling kept, as a row of
    this many ids padded with -1, so the trainer renormalises over the same set (0: off). Needs
    processed_logprobs and >= top_k; a wider kept set fails its sample (pipeline/generator/capture.py)."""
    allow_sampling_bias: bool = False
    """Accept top_p < 1 or top_k > 0 without the sampling mask: the trainer then scores the full
    vocabulary and every ratio of a truncated distribution is biased."""
    record_routing: bool = False
    """Keep Routing: record the experts every MoE layer routed each prompt and completion token to
    (``Completion.routed_experts``): vLLM's routed-experts output on its V2 model runner, the
    recorder hook (pipeline/generator/routing_capture.py; prefix caching then off) on V1
    (pipeline/generator/engine_plan.py)."""
    gpu_memory_utilization: float = 0.85
    """Share of GPU memory vLLM may use (GPU only)."""
    max_num_seqs: int | None = None
    """Most sequences decoded at once (None: 64 for the tiny models, 256 for a checkpoint)."""
    enforce_eager: bool | None = None
    """Skip torch.compile / CUDA graphs (fast start, slower decode; tests use it). None: on for the
    tiny models, off (CUDA graphs on GPU) for a checkpoint."""
    dtype: str = "auto"
    """Engine dtype: 'auto' is the checkpoint's, resolved to its name before anything starts
    (pipeline.models.defaults; vLLM's own 'auto' would run a float32 checkpoint in bfloat16),
    or float32, bfloat16, float16."""
    prefix_caching: bool = True
    """Share the prompt's KV blocks between the samples of a group. Off makes sampling independent
    of which request computed a shared prefix first (bit-reproducible synchronous runs)."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size (each TP worker joins the weight group)."""
    interrupt: str = "keep_kv"
    """What a weight update does to in-flight sequences: 'keep' (they continue on the new weights,
    KV and prefix caches cleared: each recomputes its prefix on the new weights after the pause),
    'keep_kv' (they continue on the new weights with their KV cache kept: earlier tokens' keys and
    values stay the old weights', the pause is the swap alone; requests admitted after the update
    never reuse prefix blocks computed before it), 'drain' (finish them first, admit none
    meanwhile) or 'abort' (stop them and resume each as a prefix, prompt + partial completion,
    with the remaining budget)."""
    seed: int = 0
    """Run seed; request seeds derive from it (see `request_seed`)."""
    cpu_cores: str = ""
    """CPU cores the engine's threads bind to, e.g. '0' or '0-1' (VLLM_CPU_OMP_THREADS_BIND);
    empty = vLLM's default."""
    weight_sync: str = "auto"
    """How an update arrives: 'staged' (received into host memory in the background while
    generating, one extra copy of the weights; pause only to load; a broken transfer leaves the
    old weights serving), 'streamed' (generation paused while buckets are received and loaded one
    by one, two buckets of extra memory; a broken transfer leaves the engine paused until a
    complete version arrives) or 'auto' (streamed on a GPU engine fed by broadcast, NCCL; else
    staged when the checkpoint is at most staged_max_gb). 'staged' with NCCL and TP > 1 is refused
    (docs/weight-sync.md, "No communicator deadlock")."""
    staged_max_gb: float = 8.0
    """Largest checkpoint (GB of safetensors) weight_sync='auto' stages; larger ones are streamed."""
    weight_channel: str = "broadcast"
    """What carries updates: 'broadcast' (gloo/NCCL process groups, any placement) or 'cuda_ipc'
    (one trainer rank hands its GPU buckets to one generator on the same GPU through CUDA IPC
    handles; needs one generator, TP 1 and a trainer without expert parallelism)."""
    weight_timeout_s: float = 120.0
    """Timeout of every weight-group call (join, each broadcast)."""
    start_stall_s: float = 120.0
    """How long a starting generator's engine may show no progress (its process tree's CPU seconds
    not growing, its phase unchanged) before the trainer's wait for it fails naming it and its last
    phase (`pipeline.roles.cold_start`); while it progresses, that wait has no other limit."""

    def __post_init__(self) -> None:
        if self.interrupt not in INTERRUPT_MODES:
            raise ValueError(f"generator.interrupt must be one of {INTERRUPT_MODES}, got {self.interrupt!r}")
        if self.max_tokens is not None and self.max_model_len is not None and \
                (self.max_tokens < 1 or self.max_model_len <= self.max_tokens):
            raise ValueError(f"need 1 <= max_tokens ({self.max_tokens}) < max_model_len ({self.max_model_len})")
        if self.weight_channel not in WEIGHT_CHANNELS:
            raise ValueError(f"generator.weight_channel must be one of {WEIGHT_CHANNELS}, got {self.weight_channel!r}")
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"generator.weight_sync must be one of {WEIGHT_SYNC_MODES}, got {self.weight_sync!r}")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"generator.logprobs_mode must be processed_logprobs or raw_logprobs, "
                             f"got {self.logprobs_mode!r}")
        truncated = self.top_p < 1.0 or self.top_k > 0
        if truncated and not self.sampling_mask_width and not self.allow_sampling_bias:
            raise ValueError(
                f"generator.top_p={self.top_p} / top_k={self.top_k} sample from a truncated distribution "
                "the trainer would score over the full vocabulary (biased ratios): set "
                "generator.sampling_mask_width (e.g. 64) to record the kept set, or "
                "generator.allow_sampling_bias=true to accept the bias")
        if self.sampling_mask_width:
            if self.sampling_mask_width < max(self.top_k, 1):
                raise ValueError(f"generator.sampling_mask_width={self.sampling_mask_width} must be >= "
                                 f"top_k={self.top_k} (and >= 1)")
            if self.logprobs_mode != "processed_logprobs":
                raise ValueError("generator.sampling_mask_width needs generator.logprobs_mode=processed_logprobs")


@dataclass(frozen=True)
class GroupRequest:
    """One prompt group to generate: ``n`` samples of the same prompt."""

    group_id: int
    prompt_id: int
    attempt: int
    prompt_ids: Sequence[int]
    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"group {self.group_id}: n must be >= 1, got {self.n}")
        if len(self.prompt_ids) == 0:
            raise ValueError(f"group {self.group_id}: empty prompt")
        if min(self.group_id, self.prompt_id, self.attempt) < 0:
            raise ValueError(f"group {self.group_id}: ids and attempt must be non-negative")


def request_seed(run_seed: int, group_id: int, sample_index: int, attempt: int, segment: int = 0) -> int:
    """Sampling seed of one request (see the module invariants)."""
    raw = struct.pack("<5q", run_seed, group_id, sample_index, attempt, segment)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & 0x7FFFFFFF
