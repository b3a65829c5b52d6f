"""Scalar reward shaping against AReaL 2.0: `reward_overlong_penalty`
(areal/utils/functional/functional.py) and the bias/scale/clip of
`PPOActor._compute_advantages` (areal/trainer/ppo/actor.py)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from services.trainer.algorithms.rewards import overlong_penalty

from ._views import advantages_with


def test_overlong_penalty_is_linear_and_not_capped() -> None:
    # AReaL: expected_len = max_response_length - overlong_tokens = 10 - 4 = 6;
    # penalty = min(-(L - 6)/4 * factor, 0) with factor 0.5:
    # L=3: min(0.375, 0) = 0 ; L=6: 0 ; L=8: -0.25 ; L=10: -0.5 ; L=14: -1.0 ; L=20: -1.75
    # (a cap at -factor would give -0.5 for L=14 and L=20)
    pen = overlong_penalty(
        torch.tensor([3, 6, 8, 10, 14, 20]),
        max_new_tokens=10,
        overlong_tokens=4,
        overlong_penalty_factor=0.5,
    )
    assert_close(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.75]), rtol=0, atol=1e-7)


def test_overlong_penalty_past_max_new_tokens_in_the_pipeline() -> None:
    # A multi-turn trajectory can generate more than max_new_tokens in total: 12 generated
    # tokens, max_new_tokens 10, tail 4 -> -(12 - 6)/4 * 1.0 = -1.5; reward 1 -> -0.5,
    # then (r + 0) * 1 clipped to ±20 -> -0.5.
    mask = torch.zeros(1, 14, dtype=torch.bool)
    mask[0, 2:] = True
    res = advantages_with(
        rewards=torch.tensor([1.0]),
        loss_mask=mask,
        no_eos=torch.tensor([False]),
        overlong_reward_penalty=True,
        overlong_tokens=4,
        overlong_penalty_factor=1.0,
        max_new_tokens=10,
    )
    assert_close(res.rewards, torch.tensor([-0.5]), rtol=0, atol=1e-6)
    assert_close(res.stats["overlong_penalty"], torch.tensor(-1.5), rtol=0, atol=1e-6)


def test_overlong_penalty_argument_errors() -> None:
    with pytest.raises(ValueError, match="overlong_tokens must be >= 1"):
        overlong_penalty(
            torch.tensor([1]), max_new_tokens=4, overlong_tokens=0, overlong_penalty_factor=1.0
        )
