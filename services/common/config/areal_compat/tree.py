"""The tree a translation edits: get, set and pop by dotted key, and record each AReaL key
touched as a `Translation` row."""

from __future__ import annotations

from typing import Any

from .reasons import ignore_reason
from .report import IGNORED, MAPPED, Translation

ABSENT = object()
"""What `TreeEditor.pop` returns for a key not in the tree (None is a value)."""


class TreeEditor:
    """The config tree being translated, edited by dotted key, and the rows that say what
    each rule did with the AReaL keys it touched."""

    def __init__(self, out: dict[str, Any]):
        self.out = out
        self.rows: list[Translation] = []

    def pop(self, dotted: str) -> Any:
        """Remove and return the value at `dotted`; `ABSENT` when it is not there."""
        node: Any = self.out
        parts = dotted.split(".")
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                return ABSENT
        if not isinstance(node, dict) or parts[-1] not in node:
            return ABSENT
        return node.pop(parts[-1])

    def get(self, dotted: str, default: Any = None) -> Any:
        """The value at `dotted`, or `default`."""
        node: Any = self.out
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def set(self, dotted: str, value: Any) -> None:
        """Set the value at `dotted`, making the blocks on the way."""
        node = self.out
        parts = dotted.split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                nxt = {}
                node[part] = nxt
            node = nxt
        node[parts[-1]] = value

    def mapped(self, key: str, value: Any, text: str) -> None:
        """Record that AReaL's `key` sets the Flywheel keys `text` names."""
        self.rows.append(Translation(key, value, MAPPED, text))

    def ignored(self, key: str, value: Any, reason: str) -> None:
        """Record that AReaL's `key` is accepted and not used, and why."""
        self.rows.append(Translation(key, value, IGNORED, reason))

    def drop(self, key: str, reason: str | None = None) -> Any:
        """Remove `key` and record it ignored (with `reason`, or the one for its name)."""
        value = self.pop(key)
        if value is not ABSENT:
            self.ignored(key, value, reason or ignore_reason(key))
        return value

    # -- the rules -------------------------------------------------------------------------
