"""Multi-turn episodes in the generator: model turns and environment observations in ONE token sequence.

An episode is one rollout sample whose completion is model turn 1, observation 1, model turn 2, ...
(`pipeline.protocol.record`, ``model_mask``). Invariants:

- token in, token out: turn k is generated from exactly ``prompt_ids + completion so far`` (the ids
  the engine produced and the observations' ids, never a re-tokenised conversation), so the
  trainer's sequence is the engine's; vLLM's prefix cache makes the earlier turns cheap;
- each model token keeps the version vLLM labelled it with (`Generator.complete`), whatever turn it
  is in: an episode spans weight updates like any long request; environment tokens carry logprob 0,
  ``model_mask`` 0 and the version of the model token before them (the record's version rule);
- an episode always ends with a model token: an observation is appended only if at least one
  token of the budget (``generator.max_tokens``, model and environment tokens together) is left
  after it for the next model turn; otherwise, as after ``episode.max_turns`` model turns, the
  environment has seen the last turn but its observation is not appended (no model turn would
  answer it) and the episode ends with finish reason ``length``. A model turn that does not stop on
  EOS or a stop token (``length``, ``abort``) ends the episode with its reason;
- step rewards (``episode.step_rewards``): the reward of the step that answered model turn k sits in
  ``token_rewards`` at turn k's last token, every other token 0 (the record's convention for process
  rewards: a step's score at the token that ends it);
- the sampling mask (``generator.sampling_mask_width``) holds each model token's kept set as its turn
  recorded it and a row of -1 (no set: the trainer renormalises nothing there) per environment token;
- routing (``generator.record_routing``, prefix caching off): the episode's routing is the one its
  last model turn's request computed, which ran every earlier position (prompt, earlier turns,
  observations) again: last computation wins, as within one request (`routing_capture`) and for an
  abort-resumed sample; since the episode ends with a model token, it covers every position the
  trainer feeds;
- an environment that raises or hangs (`pipeline.envs.base`) restarts the episode from its prompt
  with a fresh environment and fresh seeds, at most ``episode.env_retries`` times; then the last
  attempt's tokens are returned with finish reason ``env_error``. The loop never raises for an
  environment.

Worked example (calculator, budget 48): prompt "...37*48=...assistant\\n"; turn 1 samples
"calc 37*48<|im_end|>" (6 tokens, version 3, mask 1); the environment answers
"\\n<|im_start|>tool\\n=1776<|im_end|>\\n<|im_start|>assistant\\n" (12 tokens, logprob 0, version 3, mask 0);
a weight update lands; turn 2 samples "1776<|im_end|>" (3 tokens, version 4, mask 1); the environment
says done with reward 1.0: completion 21 tokens, versions [3]*18 + [4]*3, finish reason "stop";
with ``episode.step_rewards`` ``token_rewards`` is 0 everywhere but its last token (index 20): 1.0
(turn 1's step gave 0).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from pipeline.envs import (EnvironmentError_, EpisodeConfig, call_with_timeout, environment_class, make_environment,
                           step_with_timeout)
from pipeline.generator.completion import Completion

if TYPE_CHECKING:
    from pipeline.envs.remote import EnvironmentPool
    from pipeline.generator.engine import Generator

log = logging.getLogger(__name__)

#: Seed segments reserved per model turn (abort-mode resumes of one turn use consecutive segments).
SEGMENTS_PER_TURN = 1 << 12


@dataclass
class EpisodeRunner:
    """Runs episodes of environment `env` on a `Generator` (one runner per generator)."""

    env: str
    """Environment kind (`pipeline.envs.ENVIRONMENTS`)."""
    config: EpisodeConfig
    tokenizer: object
    """The model's tokenizer: decodes model turns for the environment, encodes observations."""
    pool: "EnvironmentPool | None" = None
    """The environment processes the environments live in (``episode.env_processes``); None: here."""

    async def run(self, gen: "Generator", prompt_ids: Sequence[int], seed_of_segment: Callable[[int], int | None],
                  budget: int, greedy: bool = False) -> "Completion":
        """One episode (see the module invariants); retried on environment failure."""
        attempts = self.config.env_retries + 1
        for attempt in range(attempts):
            done, error = await self._attempt(gen, prompt_ids, seed_of_segment, budget, greedy,
                                              first_turn=attempt * self.config.max_turns)
            if error is None:
                return done
            log.warning("episode attempt %d/%d failed: %s", attempt + 1, attempts, error)
        if not done.token_ids:  # failed before the first model turn (reset): record that turn alone
            offset = attempts * self.config.max_turns * SEGMENTS_PER_TURN
            c = await gen.complete(prompt_ids, lambda seg: seed_of_segment(offset + seg), budget, greedy)
            _append_turn(done, c)
        done.finish_reason = "env_error"
        return done

    async def _attempt(self, gen, prompt_ids, seed_of_segment, budget, greedy, first_turn):
        cfg = self.config
        done = Completion([], [], [], "length", model_mask=[], token_rewards=[])
        env = self.pool.environment(self.env) if self.pool is not None else make_environment(self.env)
        try:
            prompt_text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
            await call_with_timeout(lambda: env.reset(prompt_text), cfg.step_timeout_s, f"{self.env}.reset")
            for turn in range(cfg.max_turns):
                offset = (first_turn + turn) * SEGMENTS_PER_TURN
                c = await gen.complete(list(prompt_ids) + done.token_ids,
                                       lambda seg: seed_of_segment(offset + seg),
                                       budget - len(done.token_ids), greedy)
                _append_turn(done, c)
                if c.finish_reason != "stop":
                    return done, None
                message = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                step = await step_with_timeout(env, message, cfg.step_timeout_s)
                if cfg.step_rewards:
                    done.token_rewards[-1] = float(step.reward)
                elif step.reward:
                    _report_ignored_reward(self.env, step.reward)
                if step.done:
                    return done, None
                obs = list(self.tokenizer.encode(step.observation, add_special_tokens=False))
                if turn == cfg.max_turns - 1 or len(obs) >= budget - len(done.token_ids):
                    done.finish_reason = "length"  # no model turn would answer this observation
                    return done, None
                _append_observation(done, obs)
            raise AssertionError("unreachable: the last turn returns")
        except EnvironmentError_ as exc:
            return done, exc
        finally:
            try:
                await call_with_timeout(env.close, cfg.step_timeout_s, f"{self.env}.close")
            except EnvironmentError_ as exc:
                log.warning("%s", exc)


_ignored_reward_reported = False


def _report_ignored_reward(env: str, reward: float) -> None:
    """Say once per process that environment rewards are not used (`docs/episodes.md`, "Not done")."""
    global _ignored_reward_reported
    if _ignored_reward_reported:
        return
    _ignored_reward_reported = True
    log.warning("environment %s returned a step reward (%g): step rewards are not recorded without "
                "episode.step_rewards=true; the task's verifier alone scores each episode (docs/episodes.md)",
                env, reward)


def _append_turn(done: "Completion", c: "Completion") -> None:
    """Append model turn `c` (one `Generator.complete`): its tokens, logprobs, versions, mask 1, reward
    0, its kept sets (when recorded) and its routing, which replaces the earlier turns' (module
    invariants)."""
    done.token_ids += c.token_ids
    done.logprobs += c.logprobs
    done.versions += c.versions
    done.model_mask += [1] * len(c.token_ids)
    done.token_rewards += [0.0] * len(c.token_ids)
    if c.sampling_mask is not None:
        done.sampling_mask = (done.sampling_mask or []) + c.sampling_mask
    if c.routed_experts is not None:
        done.routed_experts = c.routed_experts
    done.finish_reason = c.finish_reason


def _append_observation(done: "Completion", obs: list[int]) -> None:
    """Append environment tokens: logprob 0, the version of the token before them, mask 0, reward 0,
    and (when the turns record kept sets) rows of -1."""
    n = len(obs)
    done.token_ids += obs
    done.logprobs += [0.0] * n
    done.versions += [done.versions[-1]] * n
    done.model_mask += [0] * n
    done.token_rewards += [0.0] * n
    if done.sampling_mask is not None:
        width = done.sampling_mask[-1].shape[1]
        done.sampling_mask = done.sampling_mask + [np.full((n, width), -1, np.int32)]


def episode_runner(cfg, model_dir: str) -> EpisodeRunner | None:
    """The runner of a run config (`pipeline.config.TokenflowConfig`) whose task has an environment
    (`pipeline.tasks.task_environment`), else None (single-turn samples)."""
    from transformers import AutoTokenizer

    from pipeline.tasks import task_environment

    env = task_environment(cfg.task, cfg.episode.environment)
    if env is None:
        return None
    environment_class(env)  # a name that does not resolve fails here, before any episode
    pool = None
    if cfg.episode.env_processes:
        from pipeline.envs.remote import EnvironmentPool

        pool = EnvironmentPool(cfg.episode.env_processes, cfg.episode.step_timeout_s, cfg.episode.env_restarts)
    return EpisodeRunner(env, cfg.episode, AutoTokenizer.from_pretrained(model_dir), pool)
