"""Command-line overrides of a config tree: `a.b.c=value`, `+a.b=value`, `~a.b`.

Applied to the raw tree before interpolation (so `gconfig.n_samples=8` also changes every
`${gconfig.n_samples}`), as AReaL's Hydra/OmegaConf users expect. Keys are checked against
the schema before anything changes, so a typo fails naming the nearest valid key instead of
being validated away later.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from .errors import ConfigError, ConfigIssue
from .key_hints import unknown_key_issue
from .root import FlywheelConfig
from .schema import _child, _is_dict, _is_list, _is_model, _unwrap

MISSING = "<missing>"
"""The value a `ConfigIssue` names when there is none to name."""
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$|^[+-]?(inf|nan)$", re.IGNORECASE)


def parse_value(text: str) -> Any:
    """Parse an override's right-hand side as YAML (`null`, `true`, `[1, 2]`, `{a: 1}`).

    Numbers in exponent form without a dot (`1e-5`) are floats, as a user means them
    (plain YAML 1.1 reads them as strings). An empty right-hand side is the empty string.
    """
    if text == "":
        return ""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(f"cannot parse {text!r} as a YAML value ({problem})") from None
    if isinstance(value, str) and _FLOAT.match(text.strip()):
        return float(value)
    return value


def apply_override(raw: dict[str, Any], override: str, *, check: bool = True) -> None:
    """Apply one `a.b.c=value`, `+a.b=value`, `++a.b=value` or `~a.b` to `raw` in place.

    Keys are checked against the schema before anything changes: an unknown key is an
    error naming the nearest valid key; below free-form dict fields (`gae_lambda_kwargs`,
    `workflow_kwargs`, ...) any key is accepted. `+` is accepted also for keys that
    already exist (AReaL users type it for keys missing from their YAML). `check=False`
    skips the schema check (overrides of an AReaL file name AReaL keys; validation after
    the translation still reports unknown ones).
    """
    text = override.strip()
    delete = text.startswith("~")
    body = text.lstrip("+~")
    if delete:
        key, _, value_text = body.partition("=")
    else:
        key, sep, value_text = body.partition("=")
        if not sep:
            raise ConfigError(
                ConfigIssue(key, MISSING, f"override {override!r} has no '='; write key=value")
            )
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(ConfigIssue(key, override, "malformed key; write a.b.c=value"))
    if check:
        _check_path(parts, value_text)
    if delete:
        _delete(raw, parts)
        return
    try:
        value = parse_value(value_text)
    except ValueError as exc:
        raise ConfigError(ConfigIssue(key, value_text, str(exc))) from None
    _assign(raw, parts, value, override)


def _check_path(parts: list[str], value: str) -> None:
    ann: Any = FlywheelConfig
    for depth, part in enumerate(parts):
        cur = _unwrap(ann)
        prefix = ".".join(parts[:depth]) + ("." if depth else "")
        if _is_model(cur):
            if part not in cur.model_fields:
                if part in getattr(cur, "legacy_keys", {}):
                    return  # validation reports the migration with the value
                raise ConfigError(unknown_key_issue(cur, part, prefix, value))
            ann = cur.model_fields[part].annotation
        elif _is_dict(cur) or cur is Any:
            return  # free-form below here
        elif _is_list(cur):
            if not part.isdigit():
                raise ConfigError(
                    ConfigIssue(prefix + part, value, f"{prefix.rstrip('.')} is a list; index it")
                )
            ann = _child(cur, part)
        else:
            raise ConfigError(
                ConfigIssue(
                    prefix.rstrip("."),
                    value,
                    f"'{prefix.rstrip('.')}' is a single value, not a block; "
                    f"it has no key '{part}'",
                )
            )


def _assign(raw: dict[str, Any], parts: list[str], value: Any, override: str) -> None:
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[int(part)]
            continue
        nxt = node.get(part)
        if nxt is None:
            # A null or absent block gets created with its defaults (`adv_norm: null`
            # plus `actor.adv_norm.std_level=null` means "a NormConfig with std off").
            nxt = {}
            node[part] = nxt
        elif not isinstance(nxt, dict | list):
            path = ".".join(parts[: depth + 1])
            raise ConfigError(
                ConfigIssue(
                    path, nxt, f"is a single value, so {override!r} cannot set a key below it"
                )
            )
        node = nxt
    last = parts[-1]
    if isinstance(node, list):
        index = int(last)
        if index >= len(node):
            raise ConfigError(
                ConfigIssue(
                    ".".join(parts),
                    value,
                    f"index {index} is past the list's end ({len(node)} items)",
                )
            )
        node[index] = value
    else:
        node[last] = value


def _delete(raw: dict[str, Any], parts: list[str]) -> None:
    node: Any = raw
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(parts[-1], None)
