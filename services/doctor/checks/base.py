"""What a check returns: its status, its numbers and one line of advice; and how statuses
combine into a verdict."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["pass", "warn", "fail", "n/a"]
SEVERITY: dict[str, int] = {"n/a": 0, "pass": 0, "warn": 1, "fail": 2}


@dataclass
class Check:
    """One check's result (`flywheel doctor --json` prints `as_dict`)."""

    name: str
    status: Status
    summary: str
    """The numbers, in one line."""
    advice: str
    """What to do about it, in one line."""
    numbers: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rounded(x: float | None, nd: int = 4) -> float | None:
    """`x` rounded for the report; None for a missing or non-finite number."""
    return None if x is None or not math.isfinite(x) else round(x, nd)


def worst(*statuses: Status) -> Status:
    """The most severe status (pass outranks n/a: a check that judged something passed)."""
    return max(statuses, key=lambda s: SEVERITY[s] + (0.5 if s == "pass" else 0))


def verdict(checks: Sequence[Check]) -> Status:
    """fail if any check fails, else warn if any warns, else pass."""
    worst = max((SEVERITY[c.status] for c in checks), default=0)
    return "fail" if worst == 2 else "warn" if worst == 1 else "pass"
