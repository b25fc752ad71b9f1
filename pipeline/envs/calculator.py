"""A calculator tool: the model writes ``calc <expression>`` as a whole turn, the environment
answers with the value; any other turn is the model's final answer and ends the episode.

Invariants:
- an expression is integers joined by ``+``, ``-`` or ``*`` (no parentheses, at most 8 operands,
  each at most 12 digits), evaluated exactly with the usual precedence; anything else answers
  ``=error`` (the episode goes on: the model may call again);
- the observation is a tool turn in the chat template's markup, ending with the assistant header
  so the model's next tokens are its next turn; the environment's reward is always 0 (the task's
  verifier scores the finished episode).

Worked example: "calc 37*48" -> observation "\\n<|im_start|>tool\\n=1776<|im_end|>\\n<|im_start|>assistant\\n";
"calc 2+3*4" -> "=14"; "calc 2**9" -> "=error"; "1776" -> done.
"""
from __future__ import annotations

import re

from pipeline.envs.base import Environment, Step

CALL = re.compile(r"^\s*calc\s+(.*?)\s*$", re.DOTALL)
EXPRESSION = re.compile(r"^\d{1,12}(?:\s*[-+*]\s*\d{1,12}){0,7}$")


def tool_turn(text: str) -> str:
    """The observation markup around a tool's answer (also used by the task's reference episode)."""
    return f"\n<|im_start|>tool\n{text}<|im_end|>\n<|im_start|>assistant\n"


def evaluate(expression: str) -> int | None:
    """The exact value of an expression of the module's grammar, else None."""
    expression = expression.strip()
    if not EXPRESSION.match(expression):
        return None
    total = 0
    for term in re.split(r"\s*(?=[-+])", expression.replace(" ", "")):
        sign = -1 if term.startswith("-") else 1
        product = 1
        for factor in term.lstrip("+-").split("*"):
            product *= int(factor)
        total += sign * product
    return total


class CalculatorEnv(Environment):
    """``calc <expression>`` -> ``=<value>``; any other turn ends the episode."""

    def step(self, message: str) -> Step:
        call = CALL.match(message)
        if call is None:
            return Step("", 0.0, done=True)
        value = evaluate(call.group(1))
        return Step(tool_turn("=error" if value is None else f"={value}"), 0.0, done=False)
