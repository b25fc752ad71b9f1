"""Multi-turn episodes in the generator: model turns and environment observations in ONE token sequence.

An episode is one rollout sample whose completion is model turn 1, observation 1, model turn 2, ...
(`pipeline.record`, ``model_mask``). Invariants:

- token in, token out: turn k is generated from exactly ``prompt_ids + completion so far`` (the ids
  the engine produced and the observations' ids, never a re-tokenised conversation), so the
  trainer's sequence is the engine's; vLLM's prefix cache makes the earlier turns cheap;
- each model token keeps the version vLLM labelled it with (`Generator.complete`), whatever turn it
  is in: an episode spans weight updates like any long request; environment tokens carry logprob 0,
  ``model_mask`` 0 and the version of the model token before them (the record's version rule);
- the token budget (``generator.max_tokens``) bounds model and environment tokens together: an
  observation that would overflow it is cut and the episode ends with finish reason ``length``, as
  does one still going after ``episode.max_turns`` model turns (the environment sees the last turn,
  its observation is not appended: no model turn would answer it); a model turn that does not stop on
  EOS or a stop token (``length``, ``abort``) ends the episode with its reason;
- episodes record neither the sampling mask nor routing (a run with ``generator.sampling_mask_width``
  or ``generator.record_routing`` and a task with an environment is refused by `pipeline.config.validate`);
- an environment that raises or hangs (`pipeline.envs.base`) restarts the episode from its prompt
  with a fresh environment and fresh seeds, at most ``episode.env_retries`` times; then the last
  attempt's tokens are returned with finish reason ``env_error``. The loop never raises for an
  environment.

Worked example (calculator, budget 48): prompt "...37*48=...assistant\\n"; turn 1 samples
"calc 37*48<|im_end|>" (6 tokens, version 3, mask 1); the environment answers
"\\n<|im_start|>tool\\n=1776<|im_end|>\\n<|im_start|>assistant\\n" (12 tokens, logprob 0, version 3, mask 0);
a weight update lands; turn 2 samples "1776<|im_end|>" (3 tokens, version 4, mask 1); the environment
says done: completion 21 tokens, versions [3]*18 + [4]*3, finish reason "stop".
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from pipeline.envs import (EnvironmentError_, EpisodeConfig, call_with_timeout, environment_class, make_environment,
                           step_with_timeout)

if TYPE_CHECKING:
    from pipeline.envs.remote import EnvironmentPool
    from pipeline.generator.engine import Completion, Generator

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
            _append(done, c.token_ids, c.logprobs, c.versions, 1)
        done.finish_reason = "env_error"
        return done

    async def _attempt(self, gen, prompt_ids, seed_of_segment, budget, greedy, first_turn):
        from pipeline.generator.engine import Completion

        cfg = self.config
        done = Completion([], [], [], "length", model_mask=[])
        env = self.pool.environment(self.env) if self.pool is not None else make_environment(self.env)
        try:
            prompt_text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
            await call_with_timeout(lambda: env.reset(prompt_text), cfg.step_timeout_s, f"{self.env}.reset")
            for turn in range(cfg.max_turns):
                offset = (first_turn + turn) * SEGMENTS_PER_TURN
                c = await gen.complete(list(prompt_ids) + done.token_ids,
                                       lambda seg: seed_of_segment(offset + seg),
                                       budget - len(done.token_ids), greedy)
                _append(done, c.token_ids, c.logprobs, c.versions, 1)
                done.finish_reason = c.finish_reason
                if c.finish_reason != "stop":
                    return done, None
                message = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                step = await step_with_timeout(env, message, cfg.step_timeout_s)
                if step.reward:
                    _report_ignored_reward(self.env, step.reward)
                if step.done:
                    return done, None
                if turn == cfg.max_turns - 1:  # no model turn would answer this observation
                    done.finish_reason = "length"
                    return done, None
                obs = list(self.tokenizer.encode(step.observation, add_special_tokens=False))
                room = budget - len(done.token_ids)
                n = min(len(obs), room)
                _append(done, obs[:n], [0.0] * n, [done.versions[-1]] * n, 0)
                if n < len(obs) or n == room:
                    done.finish_reason = "length"
                    return done, None
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
    log.warning("environment %s returned a step reward (%g): step rewards are not recorded; the task's "
                "verifier alone scores each episode (docs/episodes.md)", env, reward)


def _append(done: "Completion", ids, logprobs, versions, mask: int) -> None:
    done.token_ids += list(ids)
    done.logprobs += list(logprobs)
    done.versions += list(versions)
    done.model_mask += [mask] * len(ids)


def episode_runner(cfg, model_dir: str) -> EpisodeRunner | None:
    """The runner of a run config (`pipeline.config.TokenflowConfig`) whose task has an environment
    (`pipeline.tasks.task_environment`), else None (single-turn samples)."""
    from transformers import AutoTokenizer

    from pipeline.tasks import task_environment

    env = task_environment(cfg.task)
    if env is None:
        return None
    environment_class(env)  # a name that does not resolve fails here, before any episode
    pool = None
    if cfg.episode.env_processes:
        from pipeline.envs.remote import EnvironmentPool

        pool = EnvironmentPool(cfg.episode.env_processes, cfg.episode.step_timeout_s, cfg.episode.env_restarts)
    return EpisodeRunner(env, cfg.episode, AutoTokenizer.from_pretrained(model_dir), pool)
