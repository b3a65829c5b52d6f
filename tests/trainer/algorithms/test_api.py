"""The trainer's entry points (`api.py`): what a script calls to get the trainer's numbers."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

import services.trainer.algorithms as algorithms
from services.common.config import PPOActorConfig, TeacherConfig
from services.common.config.views import ActorLossView, AdvantageView
from services.trainer.algorithms import (
    ACTOR_TOKEN_STATS,
    actor_loss,
    approximate_prox_logp,
    batch_advantages,
    compute_prox_logp,
    gae_lambda_context,
    interpolation_alpha,
    kl_logprobs,
    summarize_token_stats,
)

from ._views import ppo_loss_with


def _actor(**kw) -> ActorLossView:
    return ActorLossView.of(PPOActorConfig(kl_ctl=0.0, **kw))


def test_every_entry_point_is_exported_with_a_docstring() -> None:
    for name in (
        "batch_advantages",
        "actor_loss",
        "gae_lambda_context",
        "approximate_prox_logp",
        "interpolation_alpha",
        "kl_logprobs",
        "compute_prox_logp",
    ):
        fn = getattr(algorithms, name)
        assert name in algorithms.__all__ and fn.__doc__, name
    assert "rollout" in algorithms.PROX_LOGP_METHODS
    assert "rollout" in algorithms.PROX_APPROX_METHODS


def test_proximal_approximations_hand_computed() -> None:
    # b = log 0.2, θ = log 0.6, α = 0.5:
    # loglinear: b + α(θ - b) = log sqrt(0.2 * 0.6) = log 0.3464102
    # linear: log(0.5 * 0.2 + 0.5 * 0.6) = log 0.4 ; rollout: b = log 0.2
    # (AReaL `compute_prox_logp_approximations`, areal/trainer/ppo/actor.py)
    b, th = torch.log(torch.tensor([0.2])), torch.log(torch.tensor([0.6]))
    alpha = torch.tensor([0.5])
    out = {m: approximate_prox_logp(m, b, th, alpha) for m in ("loglinear", "linear", "rollout")}
    assert_close(out["loglinear"], torch.log(torch.tensor([math.sqrt(0.12)])), rtol=0, atol=1e-6)
    assert_close(out["linear"], torch.log(torch.tensor([0.4])), rtol=0, atol=1e-6)
    assert_close(out["rollout"], b, rtol=0, atol=0)
    # α for a token of version 1 at current version 2 (π_θ at 3): (2 - 1)/(3 - 1) = 0.5
    assert_close(interpolation_alpha(torch.tensor([1, -1]), 2), torch.tensor([0.5, 0.0]))
    # `rollout` as a whole method: π_prox = π_behave
    res = compute_prox_logp("rollout", theta_logprobs=th, behave_logprobs=b)
    assert_close(res.prox_logprobs, b, rtol=0, atol=0)


def test_gae_lambda_context_hand_computed() -> None:
    # AReaL `_build_gae_lambda_context` (areal/trainer/ppo/gae.py): effective tokens per row,
    # non-empty turns, and the horizon of the chosen unit.
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]])
    turns = torch.tensor([[0, 0, 1, 2], [0, 1, 1, 0]])
    ctx = gae_lambda_context(mask, turns, "turn")
    assert ctx["effective_token_lengths"].tolist() == [3, 2]
    assert ctx["turn_counts"].tolist() == [2, 1]  # row 0: turns 0 and 2; row 1: turn 1
    assert ctx["timestep_lengths"].tolist() == [2, 1]
    assert gae_lambda_context(mask)["timestep_lengths"].tolist() == [3, 2]
    assert gae_lambda_context(mask)["turn_counts"].tolist() == [0, 0]
    with pytest.raises(ValueError, match="needs turn_ids"):
        gae_lambda_context(mask, None, "turn")


@pytest.mark.parametrize(
    "recompute,decoupled,uses_prox",
    [(True, False, True), (True, True, False), (False, False, False)],
)
def test_kl_reward_policy_follows_areal(recompute: bool, decoupled: bool, uses_prox: bool) -> None:
    # AReaL `PPOActor._compute_advantages`: the inference engine's log-probabilities are
    # replaced by the recomputed ones only when recompute_logprob and not use_decoupled_loss.
    actor = SimpleNamespace(recompute_logprob=recompute, use_decoupled_loss=decoupled)
    behave, prox = torch.zeros(1, 2), torch.ones(1, 2)
    assert kl_logprobs(actor, behave, prox) is (prox if uses_prox else behave)
    assert kl_logprobs(actor, behave, None) is behave


def test_batch_advantages_uses_the_kl_policy_rule() -> None:
    # One sequence, 2 generated tokens, reward 0, kl_ctl 1, k1. π_behave = -1, the
    # recomputed π = -2, π_ref = -1.5. recompute without the decoupled loss: KL = -2 + 1.5
    # = -0.5 per token -> kl reward +0.5; with the decoupled loss: KL = -1 + 1.5 = 0.5 ->
    # kl reward -0.5 (`kl_rewards` is the mean over the valid tokens).
    batch = SimpleNamespace(
        rewards=torch.zeros(1),
        loss_mask=torch.tensor([[0.0, 1.0, 1.0]]),
        no_eos=torch.zeros(1, dtype=torch.bool),
        behave_logp=torch.full((1, 3), -1.0),
        group_index=torch.zeros(1, dtype=torch.int64),
        turn_ids=None,
        attention_mask=torch.ones(1, 3, dtype=torch.bool),
    )
    kw = dict(prox_logprobs=torch.full((1, 3), -2.0), ref_logprobs=torch.full((1, 3), -1.5))
    plain = PPOActorConfig(kl_ctl=1.0, recompute_logprob=True, adv_norm=None)
    decoupled = PPOActorConfig(kl_ctl=1.0, use_decoupled_loss=True, adv_norm=None)
    for actor, kl_reward in ((plain, 0.5), (decoupled, -0.5)):
        res = batch_advantages(AdvantageView.of(actor), batch, **kw)
        assert_close(res.stats["kl_rewards"], torch.tensor(kl_reward))


def _tokens(gen: torch.Generator) -> dict[str, torch.Tensor]:
    behave = torch.randn(3, 6, generator=gen) - 2
    return {
        "logprobs": behave + 0.2 * torch.randn(3, 6, generator=gen),
        "advantages": torch.randn(3, 6, generator=gen),
        "loss_mask": torch.rand(3, 6, generator=gen) < 0.8,
        "behave_logprobs": behave,
        "versions": torch.randint(0, 3, (3, 6), generator=gen),
    }


def test_actor_loss_takes_the_proximal_method_as_an_argument(gen: torch.Generator) -> None:
    t = _tokens(gen)
    actor = _actor(use_decoupled_loss=True, prox_logp_method="recompute", ppo_n_minibatches=1)
    # `rollout`: π_prox = π_behave, so the behaviour weight is 1 and the loss is plain PPO
    # against π_behave.
    loss, stats = actor_loss(
        actor,
        t["logprobs"],
        t["advantages"],
        t["loss_mask"],
        behave_logprobs=t["behave_logprobs"],
        prox_logp_method="rollout",
    )
    plain, _ = ppo_loss_with(t["logprobs"], t["behave_logprobs"], t["advantages"], t["loss_mask"])
    assert_close(loss, plain, rtol=1e-6, atol=1e-7)
    rep = summarize_token_stats(stats, ACTOR_TOKEN_STATS)
    assert_close(rep["behave_imp_weight/avg"], torch.tensor(1.0), rtol=0, atol=1e-6)
    # `loglinear` is the same as computing π_prox by hand and calling the loss.
    loss, stats = actor_loss(
        actor,
        t["logprobs"],
        t["advantages"],
        t["loss_mask"],
        behave_logprobs=t["behave_logprobs"],
        prox_logp_method="loglinear",
        versions=t["versions"],
        current_version=2,
    )
    prox = compute_prox_logp(
        "loglinear",
        theta_logprobs=t["logprobs"],
        behave_logprobs=t["behave_logprobs"],
        versions=t["versions"],
        current_version=2,
        loss_mask=t["loss_mask"],
    )
    by_hand, _ = ppo_loss_with(
        t["logprobs"],
        prox.prox_logprobs,
        t["advantages"],
        t["loss_mask"],
        behave_logprobs=t["behave_logprobs"],
        use_decoupled_loss=True,
    )
    assert_close(loss, by_hand, rtol=0, atol=0)
    assert "prox_alpha" in stats
    # a proximal method without the decoupled loss is refused
    with pytest.raises(ValueError, match="decoupled loss only"):
        actor_loss(
            _actor(),
            t["logprobs"],
            t["advantages"],
            t["loss_mask"],
            behave_logprobs=t["behave_logprobs"],
            prox_logp_method="loglinear",
        )


def test_actor_loss_reads_the_teacher_weights(gen: torch.Generator) -> None:
    t = _tokens(gen)
    teacher_logp = t["logprobs"] - 0.1
    teacher = TeacherConfig(path="unused", rl_loss_weight=1.0, distill_loss_weight=0.5)
    loss, stats = actor_loss(
        ActorLossView.of(PPOActorConfig(), teacher),
        t["logprobs"],
        t["advantages"],
        t["loss_mask"],
        behave_logprobs=t["behave_logprobs"],
        teacher_logprobs=teacher_logp,
    )
    rl, _ = ppo_loss_with(t["logprobs"], t["behave_logprobs"], t["advantages"], t["loss_mask"])
    # log π_θ - log π_T = 0.1 on every token: loss = L_RL + 0.5 * 0.1
    assert_close(loss, rl + 0.05, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="needs the teacher config"):
        actor_loss(
            _actor(),
            t["logprobs"],
            t["advantages"],
            t["loss_mask"],
            behave_logprobs=t["behave_logprobs"],
            teacher_logprobs=teacher_logp,
        )


def test_m2po_without_the_decoupled_loss_masks_nothing_as_in_areal() -> None:
    # AReaL `PPOActor._compute_advantages` overwrites `logprobs` with the recomputed ones
    # when recompute_logprob is on without the decoupled loss, and `grpo_loss_fn` runs
    # `_apply_m2po_masking(old_logp, prox_logp, ...)` on two equal tensors: M2 = 0, nothing
    # is masked. Here π_behave differs from the recomputed π by 1.0 on one token (M2 = 1 >
    # threshold 0.05) and still nothing is masked.
    recomputed = torch.full((1, 3), -1.0)
    behave = torch.tensor([[-1.0, -2.0, -1.0]])
    _, stats = actor_loss(
        _actor(recompute_logprob=True, m2_threshold=0.05),
        recomputed.clone().requires_grad_(True),
        torch.ones(1, 3),
        torch.ones(1, 3, dtype=torch.bool),
        behave_logprobs=behave,
        recomputed_logprobs=recomputed,
    )
    assert stats["m2po_masked_fraction"] == 0.0 and stats["m2po_second_moment"] == 0.0
