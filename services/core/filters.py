"""Group filters: which trajectory groups are worth training on (DAPO dynamic sampling).

A filter decides whether a group (the completions of one prompt) is kept. With
group-relative advantages, a group whose rewards are all equal has advantage 0 everywhere
and only costs compute; DAPO drops such groups (`dapo_equal_rewards`).

One signature for every filter, `services.core.contracts.GroupFilter`: `fn(group) -> bool`
over a `TrajectoryGroup`. `resolve_group_filter` is the one resolution both config keys use
(`buffer.filter` in the buffer, `actor.should_accept_fn` in the trainer): a registered
name, or a dotted path to a `GroupFilter`. The built-in rules are formulas over the
group's rewards, registered in `FILTERS` in the older form `fn(rewards, **kwargs)`
(`RewardsFilter`) and adapted with `rewards_filter`; a dotted path whose function's first
parameter is `rewards` is adapted the same way, so configs written for that form keep
working. The adapted filters also take a bare list of rewards or a mapping with
`"rewards"` (`rewards_of`).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from services.core.contracts import GroupFilter, RewardsFilter
from services.core.plugins import Registry, RegistryError, load_dotted


def rewards_of(group: Any) -> list[float]:
    """The rewards of a group: a `TrajectoryGroup` (or anything with `.rewards`), a mapping
    with `"rewards"` (AReaL hands its filters a dict), or a plain sequence of floats."""
    if isinstance(group, Mapping):
        values = group["rewards"]
    elif hasattr(group, "rewards"):
        values = group.rewards
    else:
        values = group
    return [float(r) for r in values]


def rewards_filter(fn: Callable[..., bool], **kwargs: Any) -> GroupFilter:
    """Adapt `fn(rewards, **kwargs) -> bool` (a `RewardsFilter`, or any function of the
    rewards whose other arguments are bound here) to the `GroupFilter` signature.

    The adapted filter passes `rewards_of(group)` and the bound `kwargs`, and refuses a
    result that is not a `bool` (a truthy 1 or a numpy bool would hide a bug). Usable as a
    decorator. A dotted path in the config whose function's first parameter is named
    `rewards` is adapted this way automatically, so configs written for the older form
    keep working.
    """

    @functools.wraps(fn)
    def group_filter(group: Any) -> bool:
        result = fn(rewards_of(group), **kwargs)
        if not isinstance(result, bool):
            name = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(f"group filter {name} returned {type(result).__name__}, expected bool")
        return result

    group_filter.__flywheel_rewards_filter__ = fn  # type: ignore[attr-defined]
    return group_filter


def is_rewards_filter(fn: Callable[..., Any]) -> bool:
    """Whether a loaded function has the older form: its first parameter is `rewards`
    (one `rewards_filter` already adapted is a group filter)."""
    if hasattr(fn, "__flywheel_rewards_filter__"):
        return False
    try:
        params = list(inspect.signature(fn, follow_wrapped=False).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] == "rewards"


FILTERS: Registry[RewardsFilter] = Registry("group filter", validate=callable)


@FILTERS.register("accept_all")
def accept_all(rewards: Sequence[float], **kwargs: Any) -> bool:
    """Keep every group."""
    return True


@FILTERS.register("dapo_equal_rewards")
def dapo_equal_rewards(rewards: Sequence[float], atol: float = 1e-6, **kwargs: Any) -> bool:
    """Keep a group unless all its rewards are equal (within `atol`): DAPO's rule.

    A group of one sample is dropped too (nothing to compare). Non-finite rewards raise,
    since a NaN would otherwise silently make every group "unequal".
    """
    values = [float(r) for r in rewards]
    for r in values:
        if not math.isfinite(r):
            raise ValueError(f"dapo_equal_rewards: non-finite reward {r!r} in group {values!r}")
    if len(values) < 2:
        return False
    return (max(values) - min(values)) > atol


def resolve_group_filter(
    spec: str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    key: str = "actor.should_accept_fn",
) -> GroupFilter:
    """The `GroupFilter` a config value names: a registered name (adapted from its rewards
    form, `kwargs` bound), or a dotted path. A dotted `GroupFilter` is returned as it is;
    one whose first parameter is `rewards` is adapted with `rewards_filter`. Errors are
    `RegistryError`s (`ValueError`) that start with `key` and list the valid names."""
    bound = dict(kwargs or {})
    if spec in FILTERS:
        return rewards_filter(FILTERS.get(spec), **bound)
    if "." not in spec and ":" not in spec:
        raise RegistryError(
            f"{key}: unknown group filter {spec!r}; valid: {', '.join(FILTERS.names())} "
            "(or a dotted path 'package.module:function')"
        )
    try:
        fn = load_dotted(spec, key, require_callable=True)
    except ValueError as exc:
        raise RegistryError(str(exc)) from exc
    if is_rewards_filter(fn):
        return rewards_filter(fn, **bound)
    if bound:
        raise RegistryError(f"{key}: {spec!r} is a group filter; it takes no keyword arguments")
    return fn  # type: ignore[no-any-return]


def resolve_should_accept(
    spec: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_sampling: bool = False,
) -> GroupFilter:
    """The trainer's filter: `spec` (name or dotted path), else `dapo_equal_rewards` when
    `dynamic_sampling` is on, else `accept_all`; `kwargs` are bound to it."""
    name = spec if spec else ("dapo_equal_rewards" if dynamic_sampling else "accept_all")
    return resolve_group_filter(name, kwargs, key="actor.should_accept_fn")


def get_filter(name: str) -> GroupFilter:
    """`resolve_group_filter(name)` for the buffer (`buffer.filter`). Unknown names raise
    `RegistryError` (a `ValueError`) listing the valid ones."""
    return resolve_group_filter(name, key="buffer.filter")


G = TypeVar("G")


def filter_groups(
    groups: Iterable[G],
    should_accept: Callable[[G], bool],
) -> tuple[list[G], dict[str, float]]:
    """Keep the groups `should_accept` accepts; stats: `dynamic_filter_dropped_fraction`."""
    kept: list[G] = []
    total = 0
    for group in groups:
        total += 1
        if should_accept(group):
            kept.append(group)
    dropped = (total - len(kept)) / total if total else 0.0
    return kept, {"dynamic_filter_dropped_fraction": dropped}


__all__ = [
    "FILTERS",
    "accept_all",
    "dapo_equal_rewards",
    "filter_groups",
    "get_filter",
    "is_rewards_filter",
    "resolve_group_filter",
    "resolve_should_accept",
    "rewards_filter",
    "rewards_of",
]
