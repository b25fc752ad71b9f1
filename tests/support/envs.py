"""Test environments importable by name (``support.envs:Class``) in environment processes."""
from __future__ import annotations

import time

from pipeline.envs import Environment, Step

OBSERVATION = "\n<|im_start|>tool\n=42<|im_end|>\n<|im_start|>assistant\n"


class Echo(Environment):
    """Answers every turn with OBSERVATION; never done (the turn limit ends the episode)."""

    def step(self, message):
        return Step(OBSERVATION, 0.0, False)


class Sleepy(Environment):
    """A turn "hang" sleeps 60 s; any other turn is answered with "=<turn>" at once."""

    def step(self, message):
        if message == "hang":
            time.sleep(60)
        return Step(f"={message}", 0.5, message == "done")


class Rewarding(Environment):
    """Answers every turn with OBSERVATION and the reward ``turn + 0.25`` (turn 1, 2, ...); never done."""

    def __init__(self):
        self.turns = 0

    def step(self, message):
        self.turns += 1
        return Step(OBSERVATION, self.turns + 0.25, False)
