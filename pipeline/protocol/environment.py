"""An environment process's records (`pipeline.envs.server`, its client `pipeline.envs.remote`):
requests on channel ``ENV_REQUESTS``, answers on ``ENV_ANSWERS`` (codec: `pipeline.protocol.codec`;
no array frames).

  client -> server  `EnvReset` (``env``, ``text``), `EnvStep` (``text``), `EnvClose`
  server -> client  `EnvStepped` (answer to `EnvStep`), `EnvOk` (to `EnvReset` / `EnvClose`),
                    `EnvError` (naming what failed, to any request)

Worked example: ``EnvReset(env="calculator", text="37*48=")`` -> ``EnvOk()``; ``EnvStep("calc
37*48")`` -> ``EnvStepped(observation="...=1776...", reward=0.0, done=False)``; a ``step`` whose
``text`` is 5 -> ``EnvError("bad request: step: text: expected str, got int")``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.protocol.codec import Channel

ENV_REQUESTS = Channel("environment request")
ENV_ANSWERS = Channel("environment answer")


@ENV_REQUESTS.message
@dataclass(frozen=True)
class EnvReset:
    """Make an environment of kind ``env`` for this episode and reset it with the prompt ``text``."""
    KIND: ClassVar[str] = "reset"
    env: str
    text: str = ""


@ENV_REQUESTS.message
@dataclass(frozen=True)
class EnvStep:
    """The model's turn ``text``."""
    KIND: ClassVar[str] = "step"
    text: str = ""


@ENV_REQUESTS.message
@dataclass(frozen=True)
class EnvClose:
    """The episode is over: drop its environment."""
    KIND: ClassVar[str] = "close"


@ENV_ANSWERS.message
@dataclass(frozen=True)
class EnvStepped:
    KIND: ClassVar[str] = "step"
    observation: str
    reward: float
    done: bool


@ENV_ANSWERS.message
@dataclass(frozen=True)
class EnvOk:
    KIND: ClassVar[str] = "ok"


@ENV_ANSWERS.message
@dataclass(frozen=True)
class EnvError:
    KIND: ClassVar[str] = "error"
    error: str
