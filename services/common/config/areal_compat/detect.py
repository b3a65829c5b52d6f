"""Tell an AReaL config from a Flywheel one: the keys only AReaL has, and what an AReaL
key means when it turns up in a file read as Flywheel's."""

from __future__ import annotations

from typing import Any

from ..schema import flywheel_fields
from .fields import AREAL_FIELDS, blocks
from .reasons import COLLISIONS, ignore_reason


def areal_hint(path: str) -> str | None:
    """What an AReaL key at dotted `path` is, for a file read as Flywheel's (so that no
    "did you mean" points at a Flywheel key of the same name with another meaning); None
    when `path` is not an AReaL key."""
    if path in COLLISIONS:
        return COLLISIONS[path]
    block, _, key = path.rpartition(".")
    if block == "launcher":
        return COLLISIONS["launcher"]
    names = AREAL_FIELDS.get(block) or AREAL_FIELDS.get(block.rpartition(".")[2])
    if names and key in names:
        reason = ignore_reason(key)
        return f"`{key}` is an AReaL key of {block or 'the root'} ({reason})"
    return None


def areal_markers(raw: dict[str, Any]) -> list[str]:
    """Dotted keys of `raw` that only AReaL has: the evidence that a file is an AReaL
    config. Empty for a Flywheel file."""
    found: list[str] = []
    for path, names in AREAL_FIELDS.items():
        for node_path, node in blocks(raw, path):
            known = flywheel_fields(node_path)
            if known is None:
                continue
            for key in node:
                if key in names and key not in known:
                    found.append(f"{node_path}.{key}" if node_path else key)
    return sorted(set(found))
