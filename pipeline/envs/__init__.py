"""Environments for multi-turn episodes: the model acts, an environment answers (`base`).

`make_environment(name)` builds a fresh environment for one episode; built-in: ``calculator``
(`calculator`); any other ``module:Class`` names an importable `Environment` subclass. With
``episode.env_processes`` they run in separate processes (`remote`, `server`). The episode loop
that drives them lives in `pipeline.generator.episodes`; `docs/episodes.md` describes the design.
"""
from __future__ import annotations

from pipeline.envs.base import (Environment, EnvironmentError_, EpisodeConfig, Step, call_with_timeout,
                                 step_with_timeout)
from pipeline.envs.calculator import CalculatorEnv

ENVIRONMENTS = {"calculator": CalculatorEnv}


def environment_class(name: str) -> type[Environment]:
    """The environment kind `name`: a built-in name or ``module:Class`` (imported, checked)."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    module, _, cls = name.partition(":")
    if not cls:
        raise ValueError(f"unknown environment {name!r} (built-in: {sorted(ENVIRONMENTS)}; or module:Class)")
    import importlib

    try:
        kind = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment {name!r} cannot be imported: {exc}") from None
    if not (isinstance(kind, type) and issubclass(kind, Environment)):
        raise ValueError(f"environment {name!r} is not an Environment subclass")
    return kind


def make_environment(name: str) -> Environment:
    """A fresh environment of kind `name` (one per episode; see `environment_class`)."""
    return environment_class(name)()


__all__ = ["CalculatorEnv", "ENVIRONMENTS", "Environment", "EnvironmentError_", "EpisodeConfig", "Step",
           "call_with_timeout", "environment_class", "make_environment", "step_with_timeout"]
