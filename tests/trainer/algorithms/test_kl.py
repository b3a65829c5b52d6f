"""KL estimators and the clamped estimate behind the KL reward, against AReaL 2.0's
`KLEstimator._compute_approx_kl` (areal/utils/data.py) and `PPOActor._compute_advantages`
(areal/trainer/ppo/actor.py), which builds `KLEstimator(kl_estimator)` with
`apply_clamp=True`: estimates are clamped to [-10, 10] before `kl_ctl`."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from services.common.config.actor import PPOActorConfig
from services.common.config.views import AdvantageView
from services.trainer.algorithms.kl import kl_reward_estimate

from ._views import advantages_with


def test_estimates_are_clamped_to_ten_by_default() -> None:
    clamp = AdvantageView.of(PPOActorConfig()).kl_clamp  # the schema's default, AReaL's 10
    logp = torch.tensor([0.0, -15.0, -1.0, -0.5])
    logq = torch.tensor([-15.0, 0.0, -4.0, -0.25])
    # d = log p - log q = [15, -15, 3, -0.25]
    # k1 = d -> clamp to [-10, 10]: [10, -10, 3, -0.25]
    assert_close(
        kl_reward_estimate(logp, logq, "k1", clamp),
        torch.tensor([10.0, -10.0, 3.0, -0.25]),
        rtol=0,
        atol=1e-6,
    )
    # k2 = d^2/2 = [112.5, 112.5, 4.5, 0.03125] -> [10, 10, 4.5, 0.03125]
    assert_close(
        kl_reward_estimate(logp, logq, "k2", clamp),
        torch.tensor([10.0, 10.0, 4.5, 0.03125]),
        rtol=0,
        atol=1e-6,
    )
    # k3 = e^{-d} - 1 + d: d=15 -> 14.0000003 -> 10; d=-15 -> e^15 - 16 -> 10;
    # d=3 -> e^-3 + 2 = 2.0497871; d=-0.25 -> e^0.25 - 1.25 = 0.0340254
    assert_close(
        kl_reward_estimate(logp, logq, "k3", clamp),
        torch.tensor([10.0, 10.0, math.exp(-3) + 2, math.exp(0.25) - 1.25]),
        rtol=0,
        atol=1e-6,
    )
    # clamp=None (`actor.kl_clamp: null`) gives the raw estimate
    assert_close(
        kl_reward_estimate(logp, logq, "k1", clamp=None),
        torch.tensor([15.0, -15.0, 3.0, -0.25]),
        rtol=0,
        atol=1e-6,
    )
    assert clamp == 10.0
    with pytest.raises(ValueError, match="kl_clamp"):  # refused at load
        PPOActorConfig(kl_clamp=0.0)


def test_kl_reward_is_clamped_before_kl_ctl_in_the_pipeline() -> None:
    # One sequence, two generated tokens, d = [12, -0.5]; kl_ctl 0.1, k1, γ = λ = 1, V = 0.
    # AReaL: rewards = -kl_ctl * clamp(d, ±10) = [-1.0, 0.05]; outcome 1 on the last token.
    # A1 = 1 + 0.05 = 1.05 ; A0 = -1.0 + 1.05 = 0.05 (unclamped: -1.2 + 1.05 = -0.15)
    kwargs = dict(
        rewards=torch.tensor([1.0]),
        loss_mask=torch.tensor([[True, True]]),
        no_eos=torch.tensor([False]),
        logprobs=torch.tensor([[-1.0, -2.0]]),
        ref_logprobs=torch.tensor([[-13.0, -1.5]]),
        kl_ctl=0.1,
    )
    res = advantages_with(**kwargs)
    assert_close(res.kl_rewards, torch.tensor([[-1.0, 0.05]]), rtol=0, atol=1e-6)
    assert_close(res.advantages, torch.tensor([[0.05, 1.05]]), rtol=0, atol=1e-6)
    raw = advantages_with(**kwargs, kl_clamp=None)
    assert_close(raw.advantages, torch.tensor([[-0.15, 1.05]]), rtol=0, atol=1e-6)


def test_config_default_is_arealclamp_and_null_turns_it_off() -> None:
    assert AdvantageView.of(PPOActorConfig()).kl_clamp == 10.0
    assert AdvantageView.of(PPOActorConfig(kl_clamp=None)).kl_clamp is None
