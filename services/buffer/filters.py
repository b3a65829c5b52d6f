"""The dynamic filter: which groups are worth training on (`buffer.filter`).

A filter is a `services.core.contracts.GroupFilter`, `fn(group: TrajectoryGroup) -> bool`,
the same signature as the trainer's `actor.should_accept_fn`, resolved once at start-up so
a typo fails then, not at the first put. Resolution is the core's (`resolve_group_filter`
in `services.core.filters`, shared with the trainer), so each rule is written in one place: a registered name (`dapo_equal_rewards`, `accept_all`,
...) or a dotted path to the user's own filter (`package.module:function`).
"""

from __future__ import annotations

from services.core.contracts import GroupFilter
from services.core.filters import resolve_group_filter

__all__ = ["FilterError", "resolve_filter"]


class FilterError(ValueError):
    """A `buffer.filter` value that does not name a usable function."""


def resolve_filter(spec: str | None) -> GroupFilter | None:
    """Turn the configured name or path into a function; None/empty means no filter."""
    if not spec:
        return None
    try:
        return resolve_group_filter(spec, key="buffer.filter")
    except ValueError as err:  # RegistryError: names the key and the problem
        raise FilterError(str(err)) from None
