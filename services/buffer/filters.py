"""The dynamic filter: which groups are worth training on (`buffer.filter`).

A filter is `should_accept(group: TrajectoryGroup) -> bool`, resolved once at start-up so
a typo fails then, not at the first put. Names (`dapo_equal_rewards`, `accept_all`, ...)
come from the algorithms' filter registry (`services.trainer.algorithms.filters`, torch-free
and meant to be imported here), so each rule is written in one place; anything with a dot
or a colon is a dotted path to the user's own `fn(group) -> bool`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from services.common.codec import TrajectoryGroup

GroupFilter = Callable[[TrajectoryGroup], bool]


class FilterError(ValueError):
    """A `buffer.filter` value that does not name a usable function."""


def _from_registry(name: str) -> GroupFilter:
    from services.trainer.algorithms import filters as registry

    try:
        return registry.get_filter(name)
    except ValueError as err:  # RegistryError: lists the valid names
        raise FilterError(f"buffer.filter={name!r}: {err}") from None


def _from_dotted_path(spec: str) -> GroupFilter:
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise FilterError(
            f"buffer.filter={spec!r} is neither a registered filter name nor a dotted path "
            "like 'package.module:function'"
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
    if "." in spec or ":" in spec:
        return _from_dotted_path(spec)
    return _from_registry(spec)
