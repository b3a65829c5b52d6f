"""Dynamic filtering of whole groups before training (DAPO dynamic sampling).

A filter decides from a group's rewards whether the group is worth training on. With
group-relative advantages, a group whose rewards are all equal has advantage 0 everywhere
and only costs compute; DAPO drops such groups (`dapo_equal_rewards`).

Signature (`ShouldAccept`): `fn(rewards: Sequence[float], **kwargs) -> bool`. Pick one
by name from the registry or by dotted path (`actor.should_accept_fn`); `accept_all` is
the default. This module is torch-free on purpose: the buffer service imports it to
filter groups at admission time.
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


def resolve_should_accept(
    spec: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_sampling: bool = False,
) -> Callable[[Sequence[float]], bool]:
    """The filter to use: `spec` (name or dotted path), else `dapo_equal_rewards` when
    `dynamic_sampling` is on, else `accept_all`; `kwargs` are bound to it."""
    name = spec if spec else ("dapo_equal_rewards" if dynamic_sampling else "accept_all")
    fn = FILTERS.get(name)
    bound = functools.partial(fn, **dict(kwargs or {}))

    @functools.wraps(fn)
    def should_accept(rewards: Sequence[float]) -> bool:
        result = bound(rewards)
        if not isinstance(result, bool):
            raise TypeError(
                f"should_accept_fn {name!r} returned {type(result).__name__}, expected bool"
            )
        return result

    return should_accept


G = TypeVar("G")


def filter_groups(
    groups: Iterable[G],
    rewards_of: Callable[[G], Sequence[float]],
    should_accept: Callable[[Sequence[float]], bool],
) -> tuple[list[G], dict[str, float]]:
    """Keep the groups `should_accept` accepts; stats: `dynamic_filter_dropped_fraction`."""
    kept: list[G] = []
    total = 0
    for group in groups:
        total += 1
        if should_accept(rewards_of(group)):
            kept.append(group)
    dropped = (total - len(kept)) / total if total else 0.0
    return kept, {"dynamic_filter_dropped_fraction": dropped}
