"""Verifiers of dataset tasks: a name (or a user's function) to a reward function.

A verifier is called as ``fn(completion, answer, prompt) -> float`` in [0, 1] (``completion`` decoded
without special tokens, ``answer`` the row's ground truth as a string, ``prompt`` the row's prompt
text). `task.verifier` picks the default one and `task.reward_by_source` the one of each
``data_source``; each is one of:

- ``math-verify`` (the default): Hugging Face's math-verify parses the completion's answers (every
  ``\\boxed{}``, LaTeX, plain expressions) and the ground truth into sympy and compares them
  (fractions, radicals, intervals, sets, units, equations); 1.0 when they are equal, else 0.0.
- ``simple``: the project's own extraction (pipeline.tasks.math_answer: last ``\\boxed{}`` or last
  number, exact rationals, else text up to whitespace).
- ``module:function`` (importable) or ``/path/to/file.py:function``: the user's function. A function
  whose first parameter is named ``data_source`` is called the way verl calls its custom reward
  functions, ``fn(data_source, solution_str, ground_truth, extra_info)``.

Invariants:
- math-verify's own timeout is a SIGALRM, which only the main thread may set: on the main thread the
  verifier passes it ``MATH_VERIFY_TIMEOUT_S``; on any other thread (the orchestrator's scoring pool)
  it passes no timeout and instead bounds the work by scoring only the last ``MAX_SCORED_CHARS``
  characters of the completion (an answer is at the end of a completion; sympy's slow cases come from
  long inputs).
- A verifier name that is unknown, a module or file that cannot be imported, or an attribute that is
  not callable raises ValueError naming the setting, before anything starts.

Worked example: math-verify scores ``"so \\boxed{\\frac12}"`` against ``"0.5"`` 1.0 and `simple` 0.0
(``\\frac12`` has no braces, so `simple` compares it as text).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import threading
from collections.abc import Callable
from pathlib import Path

from pipeline.tasks.math_answer import answers_match, extract_answer

#: Seconds math-verify may spend parsing, and comparing, on the main thread.
MATH_VERIFY_TIMEOUT_S = 5
#: Characters of a completion (its end) that math-verify reads off the main thread.
MAX_SCORED_CHARS = 4000
#: The verifier a dataset task uses unless told otherwise.
DEFAULT_VERIFIER = "math-verify"

Verifier = Callable[[str, str, str], float]


def simple_verifier(completion: str, answer: str, prompt: str = "") -> float:
    """`pipeline.tasks.math_answer`: last \\boxed{} or last number against the answer."""
    predicted = extract_answer(completion)
    return 1.0 if predicted is not None and answers_match(predicted, answer) else 0.0


def math_verify_verifier(completion: str, answer: str, prompt: str = "") -> float:
    """math-verify's verdict on `completion` against the ground truth `answer` (see the module doc)."""
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    timeout = MATH_VERIFY_TIMEOUT_S if main else None
    if not main:
        completion = completion[-MAX_SCORED_CHARS:]
    gold_text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    gold = parse(gold_text, parsing_timeout=timeout)
    if not gold:  # e.g. plain words: math-verify finds no expression in them
        gold = parse(answer, parsing_timeout=timeout)
    predicted = parse(completion, parsing_timeout=timeout)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0


BUILT_IN: dict[str, Verifier] = {"math-verify": math_verify_verifier, "simple": simple_verifier}


def _import(spec: str, setting: str):
    location, _, attr = spec.rpartition(":")
    if not location or not attr:
        raise ValueError(f"{setting} must be {' | '.join(BUILT_IN)} | module:function | /path/file.py:function, "
                         f"got {spec!r}")
    try:
        if location.endswith(".py"):
            path = Path(location)
            module_spec = importlib.util.spec_from_file_location(f"tokenflow_reward_{path.stem}", path)
            if module_spec is None or not path.is_file():
                raise ImportError(f"no file {path}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(location)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, OSError, SyntaxError) as e:
        raise ValueError(f"{setting}={spec!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise ValueError(f"{setting}={spec!r} is not callable")
    return fn


def load_verifier(spec: str, setting: str = "task.verifier") -> Callable[..., float]:
    """The reward function ``spec`` names, called as ``fn(completion, answer, prompt, data_source, extra_info)``."""
    if spec in BUILT_IN:
        fn = BUILT_IN[spec]
        return lambda completion, answer, prompt, data_source, extra_info: fn(completion, answer, prompt)
    fn = _import(spec, setting)
    params = list(inspect.signature(fn).parameters)
    if params and params[0] == "data_source":
        return lambda completion, answer, prompt, data_source, extra_info: fn(
            data_source, completion, answer, json.loads(extra_info) if extra_info else None)
    return lambda completion, answer, prompt, data_source, extra_info: fn(completion, answer, prompt)
