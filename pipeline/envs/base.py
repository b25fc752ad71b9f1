"""The environment interface of a multi-turn episode, and running one step under a timeout.

An environment is created per episode, ``reset(prompt_text)`` once, then ``step(message)`` with each
model turn's text (decoded without special tokens); a step returns the observation text to append
(tokenized by the generator, after the model's end-of-turn token), a reward and whether the
episode is over. Invariants:

- the environment sees text, the record keeps tokens: observations are tokenized once by the
  generator and appended to the same token sequence, so the trainer sees exactly the engine's ids;
- an environment runs in the generator process or, with ``episode.env_processes``, in separate
  environment processes over ZeroMQ (`pipeline.envs.remote`); the episode loop is the same;
- a step runs in its own daemon thread and is waited on for at most ``EpisodeConfig.step_timeout_s``:
  an environment that raises or hangs raises `EnvironmentError_` in the episode loop, which records
  that episode as failed (finish reason ``env_error``) after ``EpisodeConfig.env_retries`` fresh
  attempts; the run and the other episodes go on. A hung step's thread is abandoned (Python cannot
  kill a thread): it is a daemon, so it never keeps the process alive.

Worked example (`pipeline.envs.calculator`): reset("37*48="); step("calc 37*48") ->
Step(observation="\\n<|im_start|>tool\\n=1776<|im_end|>\\n<|im_start|>assistant\\n", reward=0, done=False);
step("1776") -> Step("", 0, done=True): the model answered, the task's verifier scores the episode.
"""
from __future__ import annotations

import abc
import asyncio
import math
import numbers
import threading
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


@dataclass
class EpisodeConfig:
    """Limits of a multi-turn episode (tasks with an environment, e.g. ``task=toolcalc``)."""

    max_turns: int = 4
    """Model turns per episode; an episode still going after this many ends with finish reason
    ``length``. The token budget per episode is ``generator.max_tokens`` (model and environment
    tokens together)."""
    step_timeout_s: float = 5.0
    """Longest an environment step may take; a slower (or failing) step fails its episode."""
    env_retries: int = 1
    """Fresh attempts of an episode whose environment failed before it is recorded as failed
    (finish reason ``env_error``, scored like any completion)."""
    env_processes: int = 0
    """0: environments run in the generator process (each step in a thread); N > 0: in N separate
    environment processes over ZeroMQ (`pipeline.envs.remote`), episodes spread over them."""
    env_restarts: int = 100
    """Restarts of each environment process that died; past them its episodes fail."""
    environment: str = ""
    """The environment every episode runs in: a built-in name (``calculator``) or ``module:Class`` of
    an `Environment` subclass importable by the generators. Empty: the task's own (``toolcalc``:
    the calculator; other tasks have none and generate single-turn samples). Set for any task, it
    turns its prompts into episodes (the task's verifier still scores each one)."""
    step_rewards: bool = False
    """Record each environment step's reward in the rollout record's ``token_rewards``, at the last
    token of the model turn the step answered (0 on every other token; `pipeline.generator.episodes`).
    Off: step rewards are dropped and the task's verifier alone scores each episode."""

    def validate(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"episode.max_turns must be >= 1, got {self.max_turns}")
        if self.step_timeout_s <= 0:
            raise ValueError(f"episode.step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.env_retries < 0:
            raise ValueError(f"episode.env_retries must be >= 0, got {self.env_retries}")
        if self.env_processes < 0 or self.env_restarts < 0:
            raise ValueError(f"episode.env_processes and episode.env_restarts must be >= 0, got "
                             f"{self.env_processes} and {self.env_restarts}")


@dataclass(frozen=True)
class Step:
    """What an environment answers to one model turn."""

    observation: str
    """Text appended after the model's turn (empty when done)."""
    reward: float = 0.0
    """The environment's reward for this step (finite). With ``episode.step_rewards`` it is recorded
    in ``token_rewards`` at the last token of the model turn it answers; without, it is dropped (a
    non-zero one is reported once in the generator's log). The episode's scalar reward is the task's
    verifier on its transcript either way (docs/episodes.md)."""
    done: bool = False
    """The episode is over: no further model turn."""


class EnvironmentError_(RuntimeError):
    """An environment step raised or exceeded its timeout (the episode fails, not the run)."""


class Environment(abc.ABC):
    """One episode's environment (see the module docstring)."""

    def reset(self, prompt_text: str) -> None:
        """Start an episode for the prompt (as the model saw it, decoded)."""

    @abc.abstractmethod
    def step(self, message: str) -> Step:
        """React to one model turn (its text, special tokens removed)."""

    def close(self) -> None:
        """Release what the episode holds (called once it is over, also after a failure)."""


async def call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``fn()`` in a daemon thread, waited on for at most `timeout_s` seconds; a failure or a
    timeout raises `EnvironmentError_` naming `what`."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result, error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(result)

    def work() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # reported to the episode, never raised in this thread
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while a hung call ran: nobody waits any more
            pass

    threading.Thread(target=work, name=f"env-{what}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except asyncio.TimeoutError:
        raise EnvironmentError_(f"{what} took longer than {timeout_s} s") from None
    except Exception as exc:
        raise EnvironmentError_(f"{what} failed: {exc!r}") from exc


async def step_with_timeout(env: Environment, message: str, timeout_s: float) -> Step:
    """``env.step(message)`` under `call_with_timeout`; a result that is not a `Step`, or whose
    reward is not a finite number, fails too."""
    step = await call_with_timeout(lambda: env.step(message), timeout_s, f"{type(env).__name__}.step")
    if not isinstance(step, Step):
        raise EnvironmentError_(f"{type(env).__name__}.step returned {type(step).__name__}, not Step")
    if not isinstance(step.reward, numbers.Real) or not math.isfinite(step.reward):
        raise EnvironmentError_(f"{type(env).__name__}.step returned reward {step.reward!r}, not a finite number")
    return step
