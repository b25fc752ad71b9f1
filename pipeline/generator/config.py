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

INTERRUPT_MODES = ("keep", "drain", "abort")


@dataclass
class GeneratorConfig:
    """One generator (a vLLM engine plus its driver)."""

    model: str = ""
    """Hugging Face checkpoint directory (weights, config and tokenizer) the engine starts from."""
    max_model_len: int = 1024
    """Longest prompt + completion in tokens."""
    max_tokens: int = 256
    """Completion token budget per sample."""
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
    kv_cache_gib: int = 1
    """KV cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE); on GPU see gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.85
    """Share of GPU memory vLLM may use (GPU only)."""
    max_num_seqs: int = 256
    """Most sequences decoded at once."""
    enforce_eager: bool = False
    """Skip torch.compile / CUDA graphs (fast start, slower decode; tests use it)."""
    dtype: str = "auto"
    """Engine dtype ('auto' = the checkpoint's)."""
    prefix_caching: bool = True
    """Share the prompt's KV blocks between the samples of a group. Off makes sampling independent
    of which request computed a shared prefix first (bit-reproducible synchronous runs)."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size (each TP worker joins the weight group)."""
    interrupt: str = "keep"
    """What a weight update does to in-flight sequences: 'keep' (they continue on the new weights,
    KV recomputed), 'drain' (finish them first, admit none meanwhile) or 'abort' (stop them and resume
    each as a prefix, prompt + partial completion, with the remaining budget)."""
    seed: int = 0
    """Run seed; request seeds derive from it (see `request_seed`)."""
    cpu_cores: str = ""
    """CPU cores the engine's threads bind to, e.g. '0' or '0-1' (VLLM_CPU_OMP_THREADS_BIND);
    empty = vLLM's default."""
    stage_weights: bool = True
    """Receive a weight update in the background while generating and pause only to load it
    (holds one extra copy of the weights in memory while it arrives)."""
    weight_timeout_s: float = 120.0
    """Timeout of every weight-group call (join, each broadcast)."""

    def __post_init__(self) -> None:
        if self.interrupt not in INTERRUPT_MODES:
            raise ValueError(f"generator.interrupt must be one of {INTERRUPT_MODES}, got {self.interrupt!r}")
        if self.max_tokens < 1 or self.max_model_len <= self.max_tokens:
            raise ValueError(f"need 1 <= max_tokens ({self.max_tokens}) < max_model_len ({self.max_model_len})")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"generator.logprobs_mode must be processed_logprobs or raw_logprobs, "
                             f"got {self.logprobs_mode!r}")


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
