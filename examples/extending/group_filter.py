"""Group filters: keep a prompt's group only when it can teach something."""

from collections.abc import Sequence

from services.api import TrajectoryGroup, rewards_filter


def some_solved(group: TrajectoryGroup) -> bool:
    """Keep the group when at least one sample earned the full reward."""
    return any(r >= 1.0 for r in group.rewards)


def _spread(rewards: Sequence[float], minimum: float) -> bool:
    return max(rewards) - min(rewards) >= minimum


# The older form, fn(rewards, **kwargs), adapted to a group filter with its kwargs bound.
wide_spread = rewards_filter(_spread, minimum=0.5)
