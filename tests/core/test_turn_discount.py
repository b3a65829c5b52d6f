"""The multi-turn reward discount against AReaL 2.0 (commit cbff54d):
`InteractionCache.apply_reward_discount` (areal/experimental/openai/cache.py) and the
reward of its `MultiTurnWorkflow` (areal/workflow/multi_turn.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.core.turn_discount import discount_turn_rewards
from services.rollout.workflows import multi_turn


def test_backward_walk_hand_computed() -> None:
    # apply_reward_discount: over the interactions newest first, current = 0, then
    # current = current * turn_discount + reward ; reward = current.
    # r = [0.2, 0, 1], γ = 0.5: turn 2: 1 ; turn 1: 0.5·1 + 0 = 0.5 ; turn 0: 0.5·0.5 + 0.2
    assert discount_turn_rewards([0.2, 0.0, 1.0], 0.5) == pytest.approx([0.45, 0.5, 1.0])
    # γ = 1 (AReaL's default) sums the later rewards: [-1 + 0 + 2, 0 + 2, 2]
    assert discount_turn_rewards([-1.0, 0.0, 2.0]) == pytest.approx([1.0, 2.0, 2.0])
    # negative and fractional rewards, γ = 0.9: turn 1: -0.5 ; turn 0: 0.9·(-0.5) + 0.3
    assert discount_turn_rewards([0.3, -0.5], 0.9) == pytest.approx([-0.15, -0.5])
    assert discount_turn_rewards([], 0.9) == []


def test_a_turn_without_reward_counts_as_zero() -> None:
    # AReaL: "its reward is initialized to 0.0 if unset" (the newest one too, with a
    # warning): r = [1, None, None], γ = 0.5 -> [1 + 0.5·0, 0 + 0.5·0, 0]
    assert discount_turn_rewards([1.0, None, None], 0.5) == [1.0, 0.0, 0.0]
    # r = [None, 2], γ = 0.5 -> [0 + 0.5·2, 2]
    assert discount_turn_rewards([None, 2.0], 0.5) == [1.0, 2.0]


@pytest.mark.parametrize(("turns", "gamma"), [(1, 0.9), (3, 0.9), (4, 0.5), (2, 1.0)])
def test_first_turn_return_is_multi_turn_workflow_reward(turns: int, gamma: float) -> None:
    # MultiTurnWorkflow: discount *= turn_discount after every failed turn, and the episode
    # reward is reward · discount = γ^{T-1} · r_last when the failed turns score 0.
    rewards = [0.0] * (turns - 1) + [1.0]
    assert discount_turn_rewards(rewards, gamma)[0] == pytest.approx(gamma ** (turns - 1))


def test_out_of_range_discount_is_refused() -> None:
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"turn_discount must be in \[0, 1\]"):
            discount_turn_rewards([1.0], bad)


def test_the_workflow_uses_it() -> None:
    assert multi_turn.discount_turn_rewards is discount_turn_rewards


def test_importing_it_does_not_import_torch() -> None:
    # the rollout imports it; the module stays torch-free like `filters`
    code = (
        "import sys\n"
        "import services.core.turn_discount\n"
        "assert 'torch' not in sys.modules, [m for m in sys.modules if 'torch' in m][:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])
