"""The generator driver: vLLM's AsyncLLM turned into a source of `RolloutSample`s with exact versions.

Invariants:
- Input is prompt token ids; nothing is tokenized here. Each sample of a group is its own request
  (n=1) seeded by `request_seed(run seed, group, sample, attempt, segment)`; the samples of a group
  share the prompt's KV blocks through vLLM's prefix cache.
- Every completion token carries the behaviour logprob of the sampled token (``logprobs=0``, in the
  configured logprobs mode) and the policy version that sampled it. Versions come from vLLM's own
  per-output weight-version labels: the driver sets the label only while generation is paused, so a
  token's label is exactly the weights that produced it. EOS (or a stop token id) is kept with its
  logprob.
- A weight update (`update_weights`) swaps a new version in during a pause of generation and
  applies the configured interrupt mode (``keep``, ``keep_kv``, ``drain``, ``abort``): its
  invariants are `pipeline.generator.weight_update`'s (`WeightUpdateMixin`).
- With an `EpisodeRunner` (a task with an environment) a sample or an evaluation answer is a whole
  multi-turn episode (`pipeline.generator.episodes`): each turn is a `complete` call on the same
  token sequence, so everything above holds per model turn.
- Engine processes are spawned: code that builds a `Generator` must run under ``__main__`` guards.
- A signal to the whole process group (``kill -TERM -PID``, ``scancel``, ``tokenflow cancel``)
  never ends a worker on its own: workers ignore the stop signals
  (`pipeline.generator.owner_watch.ignore_stop_signals`); the owner decides (a departure's
  `Leave` first) and `shutdown` ends the engine at once: vLLM's client stands down, then EngineCore
  and its workers get SIGKILL (EngineCore may have begun its own orderly shutdown on the signal
  meanwhile: it exits its loop first, so it steps no more). Before, a departure's worker ended on
  the signal while its EngineCore, still stepping, logged a fatal ``AssertionError: collective_rpc
  should not be called on follower node``, and vLLM's graceful shutdown took 5 s more. An owner
  that dies ends them through the owner watch (`pipeline.generator.owner_watch`).
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from pipeline.generator.capture import kept_token_ids
from pipeline.generator.completion import Completion, EpisodeRunning, rollout_sample
from pipeline.generator.config import GeneratorConfig, GroupRequest, request_seed
from pipeline.generator.engine_plan import EnginePlan, engine_plan
from pipeline.generator.vllm_args import (engine_args, engine_process_env, resolve_weight_sync, sampled_logprobs,
                                          sampling_params)
from pipeline.generator.weight_update import WeightUpdateMixin
from pipeline.protocol.record import RecordSchema, RolloutSample

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


class Generator(WeightUpdateMixin):
    """Drives one vLLM AsyncLLM engine; all methods run on one asyncio loop."""

    def __init__(self, config: GeneratorConfig, generator_id: int = 0, initial_version: int = 0,
                 schema: RecordSchema | None = None, episodes: EpisodeRunning | None = None):
        self.config = config
        self.episodes = episodes  # multi-turn episodes instead of single completions (tasks with an environment)
        self.generator_id = generator_id
        self.version = initial_version
        self.schema = schema or RecordSchema()
        self.engine: AsyncLLM | None = None
        self._update_lock = asyncio.Lock()
        self._poster = None  # posts staged receives past the engine's steps (receive_post.py), made at first use
        self._abort_epoch = 0  # bumped before every abort-mode pause
        self._ids = itertools.count()
        self.routing_shape: tuple[int, int] | None = None  # (MoE layers, top_k) with record_routing
        self.start_s = 0.0
        self.weight_sync = resolve_weight_sync(config)
        self.plan: EnginePlan | None = None  # runner, compilation, routing capture: set by `start`
        self._engine_pids: list[int] = []  # processes the engine started (ended by `shutdown`)

    async def start(self) -> "Generator":
        from vllm.v1.engine.async_llm import AsyncLLM

        from pipeline.generator.owner_watch import mark_owner, private_engine_temp
        from pipeline.supervise import descendants, is_resource_tracker

        t0 = time.monotonic()
        self.plan = engine_plan(self.config)
        before = set(descendants(os.getpid()))
        mark_owner()  # the engine's processes end when this one dies, SIGKILL included
        args = engine_args(self.config)
        vllm_config = args.create_engine_config()
        with engine_process_env(vllm_config), private_engine_temp():
            self.engine = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=args.disable_log_stats)
        self._engine_pids = [p for p in descendants(os.getpid())  # the tracker ends with this process
                             if p not in before and not is_resource_tracker(p)]
        await self.engine.update_weight_version(str(self.version))
        if self.plan.routing_capture != "off":
            await self._start_routing_capture()
        self.start_s = time.monotonic() - t0
        return self

    async def _start_routing_capture(self) -> None:
        """Install the routing capture of `plan` and prove it on a probe request: every position the
        engine ran must have its routing, else the generator refuses to start (naming the plan)."""
        if self.plan.routing_capture == "hook":
            self.routing_shape = tuple((await self.engine.collective_rpc("start_routing_capture"))[0])
        else:
            model = self.engine.model_config
            self.routing_shape = (model.get_total_num_hidden_layers(), model.get_num_experts_per_tok())
        if self.schema.routed_experts not in (None, self.routing_shape):
            raise ValueError(f"the engine routes {self.routing_shape} (MoE layers, top_k), the run's "
                             f"record schema expects {self.schema.routed_experts}")
        probe = [1, 2, 3, 4]
        out, routed = await self._run(probe, sampling_params(self.config, 0, 2, greedy=True))
        missing = np.flatnonzero((routed < 0).any(axis=(1, 2)))
        if len(missing):
            raise RuntimeError(f"routing capture ({self.plan.routing_capture}, {self.plan.runner} runner, "
                               f"{self.plan.compilation}) recorded no routing for positions {missing.tolist()} "
                               f"of a {len(probe) + len(out.token_ids) - 1}-position probe request; refusing "
                               "to start (set generator.enforce_eager=true to run the hook uncompiled)")

    def engine_alive(self) -> bool:
        """False once a process the engine started has died (vLLM itself may notice much later)."""
        from pipeline.supervise import alive

        return all(alive(p) for p in self._engine_pids)

    def shutdown(self) -> None:
        """End the engine and every process it started, at once: vLLM's client stands down first
        (so it takes the engine's end for no failure), then its processes get SIGKILL (nothing in
        them needs a graceful end; its workers ignore SIGTERM)."""
        from pipeline.generator.owner_watch import release_rpc_dir
        from pipeline.supervise import end_processes

        if self._poster is not None:
            self._poster.close()
            self._poster = None
        if self.engine is not None:
            self.engine.shutdown(timeout=0)
            self.engine = None
        end_processes(self._engine_pids, grace_s=0)
        self._engine_pids = []
        release_rpc_dir()  # the engine's socket directory (`owner_watch`)

    # -- generation ---------------------------------------------------------------------------
    async def _run(self, prompt_ids: Sequence[int], params) -> tuple[Any, np.ndarray | None]:
        """The request's CompletionOutput and (``record_routing``) its routing."""
        rid = f"r{next(self._ids)}"
        final = None
        prompt: dict[str, Any] = {"prompt_token_ids": [int(t) for t in prompt_ids]}
        if self.config.interrupt == "keep_kv":
            prompt["cache_salt"] = f"v{self.version}"
        async for out in self.engine.generate(prompt, params, rid):
            final = out
        out = final.outputs[0]
        if self.routing_shape is None:
            return out, None
        positions = len(prompt_ids) + len(out.token_ids) - 1
        if self.plan.routing_capture == "vllm":  # [positions the engine ran, layers, top_k]
            routed = np.full((positions, *self.routing_shape), -1, dtype=np.int16)
            got = out.routed_experts if out.routed_experts is not None else routed[:0]
            routed[:min(positions, len(got))] = got[:positions]
            return out, routed
        raw = await self.engine.collective_rpc("take_routing", args=(rid, positions))
        return out, np.frombuffer(raw[0], dtype=np.int16).reshape(positions, *self.routing_shape)

    async def complete(self, prompt_ids: Sequence[int], seed_of_segment, max_tokens: int | None = None,
                       greedy: bool = False, temperature: float | None = None) -> Completion:
        """Generate one completion, resuming it as a prefix after each abort-mode weight update.

        ``seed_of_segment(k)`` gives the sampling seed of the k-th segment (0 before any abort);
        ``temperature``: an evaluation sample's (`sampling_params`), no sampling mask recorded."""
        budget = self.config.max_tokens if max_tokens is None else max_tokens
        done = Completion([], [], [], "length")
        for segment in itertools.count():
            epoch = self._abort_epoch
            params = sampling_params(self.config, seed_of_segment(segment), budget - len(done.token_ids), greedy,
                                     temperature)
            out, done.routed_experts = await self._run(list(prompt_ids) + done.token_ids, params)
            done.token_ids += out.token_ids
            done.logprobs += sampled_logprobs(out)
            done.versions += _token_versions(out)
            if self.config.sampling_mask_width and not greedy and temperature is None:
                done.sampling_mask = (done.sampling_mask or []) + [
                    kept_token_ids(out, self.config.sampling_mask_width)]
            done.finish_reason = out.finish_reason
            resumable = (out.finish_reason == "abort" and epoch != self._abort_epoch
                         and len(done.token_ids) < budget)
            if not resumable:
                if out.finish_reason == "abort" and len(done.token_ids) == budget:
                    done.finish_reason = "length"
                return done

    async def episode_or_completion(self, prompt_ids: Sequence[int], seed_of_segment, max_tokens: int | None = None,
                                    greedy: bool = False) -> Completion:
        """An episode (with `episodes`: `pipeline.generator.episodes`) or one completion."""
        if self.episodes is None:
            return await self.complete(prompt_ids, seed_of_segment, max_tokens, greedy)
        budget = self.config.max_tokens if max_tokens is None else max_tokens
        return await self.episodes.run(self, prompt_ids, seed_of_segment, budget, greedy)

    async def generate_sample(self, request: GroupRequest, sample_index: int) -> RolloutSample:
        t_start = time.time()
        c = await self.episode_or_completion(request.prompt_ids, lambda seg: request_seed(
            self.config.seed, request.group_id, sample_index, request.attempt, seg))
        if not c.token_ids:
            raise RuntimeError(f"group {request.group_id} sample {sample_index} ended with no tokens "
                               f"({c.finish_reason})")
        return rollout_sample(c, request, sample_index, self.generator_id, self.schema, t_start, time.time(),
                              self._record_routing(request, c))

    def _record_routing(self, request: GroupRequest, c: Completion) -> dict[str, np.ndarray]:
        """The record's routing fields (`pipeline.protocol.record`): prompt rows, completion rows with the
        never-fed last token's row -1. A position the engine never computed fails the sample."""
        if self.schema.routed_experts is None:
            return {}
        routed, p = c.routed_experts, len(request.prompt_ids)
        if routed.min() < 0:
            missing = np.flatnonzero((routed < 0).any(axis=(1, 2)))
            raise RuntimeError(f"group {request.group_id}: the engine never routed positions "
                               f"{missing[:8].tolist()} (prefix cache?); no routing to record")
        last = np.full((1, *routed.shape[1:]), -1, dtype=np.int16)
        return {"prompt_routed_experts": routed[:p], "routed_experts": np.concatenate([routed[p:], last])}

    async def generate_group(self, request: GroupRequest) -> list[RolloutSample]:
        """The group's ``n`` samples, in sample order."""
        return list(await asyncio.gather(*(self.generate_sample(request, i) for i in range(request.n))))

    async def evaluate(self, prompts: Sequence[Sequence[int]], max_tokens: int | None = None) -> list[Completion]:
        """Greedy completions of `prompts` for evaluation (not rollouts), with per-token versions:
        an update during an evaluation shows in them like in any request."""
        return list(await asyncio.gather(*(self.episode_or_completion(p, lambda seg: None, max_tokens, greedy=True)
                                           for p in prompts)))

    async def evaluate_sampled(self, prompt_ids: Sequence[int], samples: int, temperature: float, seed_of_sample,
                               max_tokens: int | None = None) -> list[Completion]:
        """`samples` completions of one held-out prompt at `temperature` (pass@k; single-turn tasks);
        ``seed_of_sample(j, segment)`` seeds the j-th."""
        return list(await asyncio.gather(*(
            self.complete(prompt_ids, lambda seg, j=j: seed_of_sample(j, seg), max_tokens, temperature=temperature)
            for j in range(samples))))


def _token_versions(output: Any) -> list[int]:
    """Per-token versions from vLLM's weight-version spans of a finished CompletionOutput."""
    n = len(output.token_ids)
    spans = output.weight_versions
    if n and not spans:
        raise RuntimeError("the engine labelled no weight version on a finished request")
    if spans and (spans[0].start != 0 or spans[-1].end != n):
        raise RuntimeError(f"weight-version spans {spans} do not cover the {n} tokens")
    if len(spans or ()) == 1:
        return [int(spans[0].version)] * n
    versions: list[int] = []
    for span in spans or ():
        versions += [int(span.version)] * (span.end - span.start)
    return versions
