"""Environments for multi-turn episodes: the model acts, an environment answers (`base`).

`make_environment(name)` builds a fresh environment for one episode; built-in: ``calculator``
(`calculator`). The episode loop that drives them lives in `pipeline.generator.episodes`;
`docs/episodes.md` describes the design.
"""
from __future__ import annotations

from pipeline.envs.base import (Environment, EnvironmentError_, EpisodeConfig, Step, call_with_timeout,
                                 step_with_timeout)
from pipeline.envs.calculator import CalculatorEnv

ENVIRONMENTS = {"calculator": CalculatorEnv}


def make_environment(name: str) -> Environment:
    """A fresh environment of kind `name` (one per episode)."""
    try:
        return ENVIRONMENTS[name]()
    except KeyError:
        raise ValueError(f"unknown environment {name!r} (known: {sorted(ENVIRONMENTS)})") from None


__all__ = ["CalculatorEnv", "ENVIRONMENTS", "Environment", "EnvironmentError_", "EpisodeConfig", "Step",
           "call_with_timeout", "make_environment", "step_with_timeout"]
