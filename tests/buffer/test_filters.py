"""The dynamic filter adapter (services/buffer/filters.py)."""

from __future__ import annotations

import pytest

from services.buffer.filters import FilterError, resolve_filter
from services.core.types import TrajectoryGroup

from .helpers import make_group


def at_most_two_samples(group: TrajectoryGroup) -> bool:
    """A user filter by dotted path: fn(group) -> bool."""
    return len(group.trajectories) <= 2


@pytest.mark.parametrize(
    ("rewards", "accepted"),
    [
        ((1.0, 1.0, 1.0), False),  # all solved: zero advantage, no gradient
        ((0.0, 0.0), False),  # all failed
        ((0.0, 1.0), True),
        ((1.0, 1.0, 0.5), True),
        ((1.0,), False),  # one sample: nothing to compare
    ],
)
def test_dapo_rule_from_the_registry(rewards: tuple[float, ...], accepted: bool) -> None:
    dapo = resolve_filter("dapo_equal_rewards")
    assert dapo is not None
    assert dapo(make_group("g", rewards=rewards)) is accepted


def test_resolution() -> None:
    assert resolve_filter(None) is None and resolve_filter("") is None
    assert resolve_filter("accept_all")(make_group("g", rewards=(1.0, 1.0))) is True  # type: ignore[misc]
    module = at_most_two_samples.__module__
    for spec in (f"{module}:at_most_two_samples", f"{module}.at_most_two_samples"):
        fn = resolve_filter(spec)
        assert fn is at_most_two_samples
        assert fn(make_group("g", rewards=(0.0, 1.0, 1.0))) is False


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_filter", "dapo_equal_rewards"),  # the registry lists the valid names
        ("no_such_pkg.mod:fn", "buffer.filter: cannot import module 'no_such_pkg.mod'"),
        ("services.buffer.filters:missing", "has no attribute 'missing'"),
        ("services.buffer.filters:", "is not a dotted path"),
        ("services.buffer.filters:FilterError.args", "not a callable"),
    ],
)
def test_bad_filters_fail_at_start_naming_the_problem(spec: str, message: str) -> None:
    with pytest.raises(FilterError, match=message):
        resolve_filter(spec)
