"""What a config error says about a key: "did you mean", the block a key lives in, the
AReaL key of the same name, the field's own description.

Shared by the override parser (`overrides.py`), which checks keys before anything changes,
and by validation (`loader.py`), which reports unknown keys found in a file; one wording for
both, so a key is named the same way whichever way it came in.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from . import areal_compat
from .errors import ConfigIssue
from .root import FlywheelConfig
from .schema import _child, _is_model, _unwrap


def known_keys(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def suggest(model: type[BaseModel], key: str, prefix: str) -> str:
    """'did you mean ...' text for an unknown `key` of `model` (located at `prefix`)."""
    known = known_keys(model)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:
        # A key written in the wrong block (`actor.n_samples`) is found elsewhere.
        elsewhere = [p for p in all_paths(FlywheelConfig) if p.rsplit(".", 1)[-1] == key]
        if elsewhere:
            return f"did you mean '{elsewhere[0]}'? (`{key}` lives in another block)"
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.4)
    if close:
        return f"did you mean '{prefix}{close[0]}'?"
    listed = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
    return f"valid keys here: {listed}"


def all_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths: list[str] = []
    for name, field in model.model_fields.items():
        paths.append(prefix + name)
        ann = _unwrap(field.annotation)
        if _is_model(ann):
            paths.extend(all_paths(ann, prefix + name + "."))
    return paths


def unknown_key_issue(model: type[BaseModel], key: str, prefix: str, value: Any) -> ConfigIssue:
    migration = getattr(model, "legacy_keys", {}).get(key)
    if migration:
        return ConfigIssue(prefix + key, value, migration)
    collision = areal_compat.areal_hint(prefix + key)
    if collision:
        # Same name, another meaning: a "did you mean" would point at the wrong key.
        return ConfigIssue(
            prefix + key,
            value,
            f"{collision}; this file is read as a Flywheel config: load it with "
            "`--from areal` (source='areal') to translate AReaL keys",
        )
    return ConfigIssue(
        prefix + key,
        value,
        f"unknown key '{key}' in {prefix.rstrip('.') or 'the root'}; "
        + suggest(model, key, prefix),
    )


def field_description(path: Sequence[str]) -> str:
    """First sentence of the docstring of the field at `path`, if there is one."""
    ann: Any = FlywheelConfig
    parent: Any = None
    for key in path:
        parent = _unwrap(ann)
        ann = _child(ann, key)
        if ann is None:
            return ""
    if _is_model(parent) and path and path[-1] in parent.model_fields:
        text = parent.model_fields[path[-1]].description or ""
        return " ".join(text.split()).split(". ")[0].rstrip(".")
    return ""
