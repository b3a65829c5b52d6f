"""The translation's report: one row per AReaL key touched, and its text table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAPPED = "mapped"
IGNORED = "ignored"


@dataclass(frozen=True)
class Translation:
    """One AReaL key and what Flywheel does with it."""

    key: str
    """Dotted AReaL key (`actor.backend`)."""

    value: Any
    """The value in the file (after interpolation)."""

    action: str
    """`mapped` (sets the Flywheel keys named in `flywheel`) or `ignored`."""

    flywheel: str
    """What Flywheel does: the keys it sets, or why the key is not used."""


def format_table(rows: list[Translation]) -> list[str]:
    """The translation as aligned text lines: AReaL key, value, what Flywheel does."""
    if not rows:
        return []
    shown = [(r.key, _short(r.value), f"{r.action}: {r.flywheel}") for r in rows]
    w0 = max(len("AReaL key"), *(len(k) for k, _, _ in shown))
    w1 = min(28, max(len("value"), *(len(v) for _, v, _ in shown)))
    lines = [f"{'AReaL key':<{w0}}  {'value':<{w1}}  Flywheel"]
    lines += [f"{k:<{w0}}  {v:<{w1}}  {t}" for k, v, t in shown]
    return lines


def _short(value: Any) -> str:
    if isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {_short(v)}" for k, v in list(value.items())[:3])
        return text + (", ...}" if len(value) > 3 else "}")
    if isinstance(value, list):
        if len(value) > 2 or any(isinstance(v, dict | list) for v in value):
            return f"[{len(value)} items]"
        return "[" + ", ".join(_short(v) for v in value) + "]"
    text = "null" if value is None else str(value)
    return text if len(text) <= 28 else text[:25] + "..."
