"""The doctor's registry: the findings of one run's checks and the ordered list of checks.

`check("name")` registers a check function; `pipeline.doctor.checks` holds the checks themselves
and `pipeline.doctor.run_checks` runs them in registration order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Tuple


@dataclass
class Finding:
    check: str  # the registered check's name
    refused: bool  # True: a contradiction, the run must not start
    text: str


@dataclass
class Run:
    """What the checks look at (a resolved config and its job plan) and what they found."""

    cfg: Any  # the resolved TokenflowConfig (pipeline.config.validate ran)
    plan: Any  # its pipeline.launch.plan.JobPlan
    findings: List[Finding] = field(default_factory=list)
    current: str = ""  # the check running now

    def uses(self, text: str) -> None:
        self.findings.append(Finding(self.current, False, text))

    def refuse(self, text: str) -> None:
        self.findings.append(Finding(self.current, True, text))

    @property
    def refusals(self) -> List[Finding]:
        return [f for f in self.findings if f.refused]


CHECKS: List[Tuple[str, Callable[[Run], None]]] = []


def check(name: str) -> Callable[[Callable[[Run], None]], Callable[[Run], None]]:
    """Register a check (run in registration order)."""
    def register(fn: Callable[[Run], None]) -> Callable[[Run], None]:
        CHECKS.append((name, fn))
        return fn
    return register
