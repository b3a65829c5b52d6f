"""Dynamic filtering of whole groups before training (DAPO dynamic sampling).

A filter decides from a group's rewards whether the group is worth training on. With
group-relative advantages, a group whose rewards are all equal has advantage 0 everywhere
and only costs compute; DAPO drops such groups (`dapo_equal_rewards`).

Signature (`ShouldAccept`): `fn(rewards: Sequence[float], **kwargs) -> bool`. Pick one
by name from the registry or by dotted path (`actor.should_accept_fn`, `buffer.filter`);
`accept_all` is the default. The function `resolve_should_accept` / `get_filter` return
accepts a list of rewards, or a group object with a `.rewards` attribute (the buffer's
`TrajectoryGroup`) or a `"rewards"` key. This module is torch-free on purpose: the buffer
service imports it to filter groups at admission time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from .registry import Registry


class ShouldAccept(Protocol):
    """`(rewards of one group) -> keep the group?`."""

    def __call__(self, rewards: Sequence[float], **kwargs: Any) -> bool: ...


FILTERS: Registry[ShouldAccept] = Registry("dynamic filter (should_accept_fn)", validate=callable)


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


def rewards_of(group: Any) -> list[float]:
    """The rewards of a group given as a list of floats, an object with `.rewards`, or a
    mapping with `"rewards"`."""
    if isinstance(group, Mapping):
        values = group["rewards"]
    elif hasattr(group, "rewards"):
        values = group.rewards
    else:
        values = group
    return [float(r) for r in values]


def resolve_should_accept(
    spec: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_sampling: bool = False,
) -> Callable[[Any], bool]:
    """The filter to use: `spec` (name or dotted path), else `dapo_equal_rewards` when
    `dynamic_sampling` is on, else `accept_all`; `kwargs` are bound to it. The returned
    function takes a group's rewards (or the group itself, see `rewards_of`)."""
    name = spec if spec else ("dapo_equal_rewards" if dynamic_sampling else "accept_all")
    fn = FILTERS.get(name)
    bound_kwargs = dict(kwargs or {})

    @functools.wraps(fn)
    def should_accept(group: Any) -> bool:
        result = fn(rewards_of(group), **bound_kwargs)
        if not isinstance(result, bool):
            raise TypeError(
                f"should_accept_fn {name!r} returned {type(result).__name__}, expected bool"
            )
        return result

    return should_accept


def get_filter(name: str) -> Callable[[Any], bool]:
    """`resolve_should_accept(name)`: the lookup the buffer service uses for names it does
    not know itself. Unknown names raise `RegistryError` (a `ValueError`) listing valid ones."""
    return resolve_should_accept(name)


G = TypeVar("G")


def filter_groups(
    groups: Iterable[G],
    should_accept: Callable[[Any], bool],
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
