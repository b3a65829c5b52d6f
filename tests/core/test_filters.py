"""Dynamic filtering: DAPO's equal-rewards rule, resolution by name/path, torch-free import."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from services.core.filters import (
    FILTERS,
    dapo_equal_rewards,
    filter_groups,
    get_filter,
    resolve_should_accept,
)
from services.core.plugins import RegistryError


def test_dapo_equal_rewards() -> None:
    assert dapo_equal_rewards([1.0, 1.0, 1.0]) is False  # all correct: no signal
    assert dapo_equal_rewards([0.0, 0.0]) is False  # all wrong: no signal
    assert dapo_equal_rewards([0.0, 1.0, 1.0]) is True
    assert dapo_equal_rewards([1.0]) is False  # nothing to compare
    assert dapo_equal_rewards([0.5, 0.5 + 1e-9]) is False  # within atol
    with pytest.raises(ValueError, match="non-finite reward nan"):
        dapo_equal_rewards([0.0, float("nan")])


@dataclass
class _Group:
    group_id: str
    rewards: list[float] = field(default_factory=list)


def test_resolution_defaults_groups_and_stats() -> None:
    keep_all = resolve_should_accept(None)
    assert keep_all([1.0, 1.0]) is True
    dapo = resolve_should_accept(None, dynamic_sampling=True)
    groups = [_Group("a", [1, 1]), _Group("b", [0, 1]), _Group("c", [0, 0]), _Group("d", [1, 0])]
    kept, stats = filter_groups(groups, dapo)
    assert [g.group_id for g in kept] == ["b", "d"]
    assert stats == {"dynamic_filter_dropped_fraction": 0.5}
    # what the buffer calls for names it does not know; accepts group objects and mappings
    fn = get_filter("dapo_equal_rewards")
    assert fn(_Group("x", [0, 1])) is True and fn({"rewards": [2, 2]}) is False
    # a tolerance bound through kwargs
    loose = resolve_should_accept("dapo_equal_rewards", {"atol": 0.5})
    assert loose([0.0, 0.4]) is False


def _at_least_one_half(rewards, **kwargs):  # type: ignore[no-untyped-def]
    return sum(rewards) / len(rewards) >= 0.5


def _not_a_bool(rewards, **kwargs):  # type: ignore[no-untyped-def]
    return 1


def test_dotted_path_and_errors() -> None:
    fn = resolve_should_accept(f"{__name__}._at_least_one_half")
    assert fn([1.0, 0.0]) is True and fn([0.0, 0.0, 1.0]) is False
    with pytest.raises(TypeError, match="returned int, expected bool"):
        resolve_should_accept(f"{__name__}._not_a_bool")([1.0])
    with pytest.raises(RegistryError, match="valid: accept_all, dapo_equal_rewards"):
        resolve_should_accept("dapo")
    with pytest.raises(RegistryError, match="has no attribute 'nope'"):
        resolve_should_accept(f"{__name__}.nope")
    with pytest.raises(RegistryError, match="already registered"):
        FILTERS.add("dapo_equal_rewards", _at_least_one_half)


def test_filters_module_does_not_import_torch() -> None:
    code = (
        "import sys; import services.core.filters as f; "
        "assert 'torch' not in sys.modules, 'torch was imported'; "
        "assert f.get_filter('dapo_equal_rewards')([0, 1])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
