"""The dynamic filter: which groups are worth training on (`buffer.filter`).

A filter is `should_accept(group: TrajectoryGroup) -> bool`. The DAPO rule is built in:
a group whose rewards are all equal has zero advantage after group normalisation, so it
carries no gradient and only dilutes the batch. Other filters come by dotted path
(`package.module:function` or `package.module.function`), resolved once at start-up so a
typo fails then, not at the first put.

This module is the buffer's small adapter over the filter registry; names it does not know
are looked up in the algorithms' registry (`services.trainer.algorithms.filters`) when that
module is importable, so the buffer never depends on trainer internals to start.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from services.common.codec import TrajectoryGroup

GroupFilter = Callable[[TrajectoryGroup], bool]


class FilterError(ValueError):
    """A `buffer.filter` value that does not name a usable function."""


def dapo_equal_rewards(group: TrajectoryGroup) -> bool:
    """Accept a group unless all its rewards are equal (DAPO dynamic sampling).

    Exact equality: rewards are outcome scores (0/1, or a few discrete levels), so two
    rewards that differ at all give a non-zero group-normalised advantage.
    """
    rewards = group.rewards
    return any(r != rewards[0] for r in rewards[1:])


BUILTIN: dict[str, GroupFilter] = {"dapo_equal_rewards": dapo_equal_rewards}


def _from_registry(name: str) -> GroupFilter | None:
    try:
        registry = importlib.import_module("services.trainer.algorithms.filters")
    except ImportError:
        return None
    for getter in ("get_filter", "resolve_filter"):
        fn = getattr(registry, getter, None)
        if callable(fn):
            try:
                return fn(name)
            except (KeyError, ValueError, ImportError, AttributeError):
                return None
    return None


def _from_dotted_path(spec: str) -> GroupFilter:
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise FilterError(
            f"buffer.filter={spec!r} is neither a built-in filter {sorted(BUILTIN)} "
            "nor a dotted path like 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise FilterError(f"buffer.filter={spec!r}: cannot import {module_name!r}: {err}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise FilterError(f"buffer.filter={spec!r}: {module_name!r} has no function {attr!r}")
    return fn


def resolve_filter(spec: str | None) -> GroupFilter | None:
    """Turn the configured name or path into a function; None/empty means no filter."""
    if not spec:
        return None
    if spec in BUILTIN:
        return BUILTIN[spec]
    if "." not in spec and ":" not in spec:
        found = _from_registry(spec)
        if found is None:
            raise FilterError(
                f"buffer.filter={spec!r} is unknown; built-in filters: {sorted(BUILTIN)}, "
                "or give a dotted path like 'package.module:function'"
            )
        return found
    return _from_dotted_path(spec)
