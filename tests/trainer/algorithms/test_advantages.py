"""The rewards → advantages pipeline: shaping, KL, truncation flag, GAE modes, norms."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from services.trainer.algorithms.advantages import compute_advantages
from services.trainer.algorithms.layout import padded_to_packed
from services.trainer.algorithms.normalization import NormSpec
from services.trainer.algorithms.rewards import overlong_penalty, shape_rewards
from services.trainer.algorithms.stats import check_stat_names


def _kl_case(estimator: str) -> torch.Tensor:
    res = compute_advantages(
        rewards=torch.tensor([1.0]),
        loss_mask=torch.tensor([[False, True, True]]),
        no_eos=torch.tensor([False]),
        logprobs=torch.tensor([[0.0, -1.0, -2.0]]),
        ref_logprobs=torch.tensor([[0.0, -1.5, -1.0]]),
        kl_ctl=0.1,
        kl_estimator=estimator,
    )
    check_stat_names(res.stats)
    return res.advantages


def test_kl_shaping_k1_k2_k3_hand_computed() -> None:
    # log π_old - log π_ref = [0.5, -1.0] on the two generated tokens; γ = λ = 1, V = 0.
    # k1: kl = [0.5, -1.0] -> rewards -0.1*kl = [-0.05, 0.1]; outcome 1 on the last token
    #     A1 = 1.1 ; A0 = -0.05 + 1.1 = 1.05
    assert_close(_kl_case("k1"), torch.tensor([[0.0, 1.05, 1.1]]), rtol=0, atol=1e-6)
    # k2: 0.5*[0.25, 1.0] = [0.125, 0.5] -> [-0.0125, -0.05]; A1 = 0.95 ; A0 = 0.9375
    assert_close(_kl_case("k2"), torch.tensor([[0.0, 0.9375, 0.95]]), rtol=0, atol=1e-6)
    # k3 with d = log π_ref - log π_old = [-0.5, 1.0]: e^d - 1 - d = [0.1065307, 0.7182818]
    # rewards [-0.01065307, -0.07182818]; A1 = 0.9281718 ; A0 = 0.9175187
    assert_close(_kl_case("k3"), torch.tensor([[0.0, 0.9175187, 0.9281718]]), rtol=0, atol=1e-6)


def test_turn_mode_keeps_kl_out_of_the_recurrence() -> None:
    kwargs = dict(
        rewards=torch.tensor([1.0]),
        loss_mask=torch.ones(1, 4, dtype=torch.bool),
        no_eos=torch.tensor([False]),
        logprobs=torch.tensor([[-1.0, -1.0, -1.0, -1.0]]),
        ref_logprobs=torch.tensor([[-1.1, -1.2, -1.3, -1.4]]),
        turn_ids=torch.tensor([[0, 0, 1, 1]]),
        kl_ctl=1.0,
    )
    # k1 kl = [0.1, 0.2, 0.3, 0.4] -> kl rewards -[0.1, 0.2, 0.3, 0.4]
    tok = compute_advantages(**kwargs, gae_timestep_unit="token")
    # token mode: A_t = 1 + Σ_{t' >= t} kl_t' = [0, 0.1, 0.3, 0.6]
    assert_close(tok.advantages, torch.tensor([[0.0, 0.1, 0.3, 0.6]]), rtol=0, atol=1e-6)
    turn = compute_advantages(**kwargs, gae_timestep_unit="turn")
    # turn mode: task advantage 1 for both turns, plus each token's own KL reward
    assert_close(turn.advantages, torch.tensor([[0.9, 0.8, 0.7, 0.6]]), rtol=0, atol=1e-6)
    # critic targets exclude the KL in turn mode
    assert_close(turn.returns, torch.ones(1, 4), rtol=0, atol=1e-6)


def test_overlong_penalty_and_reward_shaping_hand_computed() -> None:
    # max_new_tokens 10, tail 4: expected length 6 -> L=5: 0 ; L=8: -(8-6)/4 = -0.5 ; L=10: -1
    pen = overlong_penalty(
        torch.tensor([5, 8, 10]), max_new_tokens=10, overlong_tokens=4, overlong_penalty_factor=1.0
    )
    assert_close(pen, torch.tensor([0.0, -0.5, -1.0]), rtol=0, atol=0)
    # (r + bias) * scale, clipped: r=1 -> (1-0.5)*2 = 1 -> 0.8 ; r=0 -> -1 -> -0.8 ; r=0.6 -> 0.2
    shaped = shape_rewards(
        torch.tensor([1.0, 0.0, 0.6]), reward_bias=-0.5, reward_scaling=2.0, reward_clip=0.8
    )
    assert_close(shaped, torch.tensor([0.8, -0.8, 0.2]), rtol=0, atol=1e-6)
    # in the pipeline: generated lengths 5 and 8, rewards 1 and 1 -> 1 and 0.5
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 1:6] = True
    mask[1, 1:9] = True
    res = compute_advantages(
        rewards=torch.tensor([1.0, 1.0]),
        loss_mask=mask,
        no_eos=torch.tensor([False, False]),
        overlong_reward_penalty=True,
        overlong_tokens=4,
        overlong_penalty_factor=1.0,
        max_new_tokens=10,
    )
    assert_close(res.rewards, torch.tensor([1.0, 0.5]), rtol=0, atol=1e-6)
    assert_close(res.stats["overlong_penalty"], torch.tensor(-0.25), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="overlong_tokens, overlong_penalty_factor"):
        compute_advantages(
            rewards=torch.ones(2),
            loss_mask=mask,
            no_eos=torch.zeros(2, dtype=torch.bool),
            overlong_reward_penalty=True,
        )


def test_truncation_comes_from_the_no_eos_flag_not_the_padding() -> None:
    # Row 0 fills the padded width but ended with EOS; row 1 is short but truncated.
    # AReaL's heuristic (length == width) would get both wrong.
    mask = torch.tensor([[True, True, True], [True, True, False]])
    values = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    res = compute_advantages(
        rewards=torch.tensor([0.0, 0.0]),
        loss_mask=mask,
        no_eos=torch.tensor([False, True]),
        values=values,
        bootstrap_values=torch.tensor([5.0, 2.0]),
    )
    # row 0: EOS -> bootstrap ignored -> all 0 ; row 1: bootstrap 2 flows back with γ=λ=1
    assert_close(res.advantages, torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 0.0]]), rtol=0, atol=0)
    assert_close(res.stats["no_eos_ratio"], torch.tensor(0.5), rtol=0, atol=0)
    with pytest.raises(ValueError, match="bootstrap_values .* are required"):
        compute_advantages(
            rewards=torch.zeros(2),
            loss_mask=mask,
            no_eos=torch.tensor([False, True]),
            values=values,
        )


def test_mask_no_eos_with_zero_removes_truncated_sequences() -> None:
    mask = torch.ones(3, 2, dtype=torch.bool)
    res = compute_advantages(
        rewards=torch.tensor([1.0, 0.0, 5.0]),
        loss_mask=mask,
        no_eos=torch.tensor([False, False, True]),
        group_ids=[0, 0, 0],
        reward_norm=NormSpec("group", False, None),
        mask_no_eos_with_zero=True,
    )
    # the truncated row leaves the loss and the group statistics: mean of [1, 0] = 0.5
    assert res.loss_mask.tolist() == [[True, True], [True, True], [False, False]]
    assert_close(res.rewards, torch.tensor([0.5, -0.5, 0.0]), rtol=0, atol=1e-6)
    assert_close(res.advantages[2], torch.zeros(2), rtol=0, atol=0)


def test_grpo_pipeline_with_unequal_groups_hand_computed() -> None:
    # groups p1 = [1, 0, 0], p2 = [1, 1] (unequal after filtering); group mean/std norm,
    # then γ = λ = 1 broadcasts each normalised reward over its tokens.
    lengths = [2, 3, 1, 2, 4]
    mask = torch.zeros(5, 4, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    res = compute_advantages(
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0]),
        loss_mask=mask,
        no_eos=torch.zeros(5, dtype=torch.bool),
        group_ids=["p1", "p1", "p1", "p2", "p2"],
        reward_norm=NormSpec("group", False, "group"),
    )
    # p1: (1 - 1/3)/sqrt(1/3) = 1.1547005 ; (0 - 1/3)/sqrt(1/3) = -0.5773503 ; p2: 0
    per_seq = torch.tensor([1.1547005, -0.5773503, -0.5773503, 0.0, 0.0])
    expected = torch.where(mask, per_seq.unsqueeze(1), 0.0)
    assert_close(res.advantages, expected, rtol=0, atol=1e-4)
    assert_close(res.stats["task_reward"], torch.tensor(0.6), rtol=0, atol=1e-6)
    assert res.stats["correct_n_seqs"] == 3 and res.stats["incorrect_n_seqs"] == 2


def test_reward_norm_counts_every_sequence_and_adv_norm_every_token() -> None:
    # AReaL 2.0 `PPOActor._compute_advantages` (areal/trainer/ppo/actor.py): reward_norm is
    # called without a mask (every sequence's reward counts, an empty completion's too), and
    # adv_norm with the loss mask (every generated token counts once).
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    res = compute_advantages(
        rewards=torch.tensor([1.0, 0.0, 0.0]),
        loss_mask=mask,
        no_eos=torch.zeros(3, dtype=torch.bool),
        group_ids=[0, 0, 0],
        reward_norm=NormSpec("group", False, None),
        adv_norm=NormSpec("batch", False, "batch"),
    )
    # reward_norm: mean (1 + 0 + 0)/3 = 1/3 -> [2/3, -1/3, -1/3]
    assert_close(res.rewards, torch.tensor([2 / 3, -1 / 3, -1 / 3]), rtol=0, atol=1e-6)
    # γ = λ = 1: A = [2/3]*3 on row 0, [-1/3] on row 1. adv_norm over the 4 tokens:
    # mean (3*2/3 - 1/3)/4 = 5/12; deviations 1/4 (x3), -3/4; unbiased var
    # (3/16 + 9/16)/3 = 1/4 -> std 0.5; out = [0.25, -0.75]/(0.5 + 1e-5) = [0.49999, -1.49997]
    expected = torch.tensor([[0.4999900, 0.4999900, 0.4999900], [-1.4999700, 0.0, 0.0]])
    assert_close(res.advantages[:2], expected, rtol=0, atol=1e-6)
    assert_close(res.advantages[2], torch.zeros(3), rtol=0, atol=0)


def test_outcome_reward_sits_on_the_last_generated_token() -> None:
    # A multi-turn trajectory that ends in tool/feedback tokens (loss_mask 0 at the end).
    # AReaL (`PPOActor._compute_advantages`) puts the reward at the sequence's last token,
    # which takes no GAE step, so the reward would be lost; Flywheel puts it on the last
    # generated token (position 3 here): γ = λ = 1, V = 0 -> A = 1 on every generated token.
    mask = torch.tensor([[False, True, False, True, False, False]])
    res = compute_advantages(
        rewards=torch.tensor([1.0]), loss_mask=mask, no_eos=torch.tensor([False])
    )
    assert res.token_rewards.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]
    assert res.advantages.tolist() == [[0.0, 1.0, 0.0, 1.0, 0.0, 0.0]]


def test_packed_equals_padded(gen: torch.Generator) -> None:
    b, t = 6, 8
    lengths = torch.randint(2, t + 1, (b,), generator=gen)
    valid = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    mask = valid & (torch.arange(t).unsqueeze(0) >= 1)  # position 0 is the prompt
    turn = torch.where(mask, torch.arange(t).expand(b, t) // 3, -1)
    kwargs = dict(
        rewards=torch.randn(b, generator=gen),
        no_eos=torch.rand(b, generator=gen) < 0.5,
        bootstrap_values=torch.randn(b, generator=gen),
        group_ids=[0, 0, 0, 1, 1, 2],
        kl_ctl=0.05,
        kl_estimator="k3",
        discount=0.99,
        gae_lambda="vapo_length_adaptive",
        gae_lambda_kwargs={"alpha": 0.5},
        reward_norm=NormSpec("group", True, None),
        adv_norm=NormSpec("batch", False, "batch"),
    )
    per_token = {
        "loss_mask": mask,
        "logprobs": torch.randn(b, t, generator=gen) - 1,
        "ref_logprobs": torch.randn(b, t, generator=gen) - 1,
        "values": torch.randn(b, t, generator=gen),
        "turn_ids": turn,
    }
    for unit in ("token", "turn"):
        pad = compute_advantages(**per_token, **kwargs, gae_timestep_unit=unit)
        cu = padded_to_packed(mask, lengths)[1]
        packed = {k: padded_to_packed(v, lengths)[0] for k, v in per_token.items()}
        pack = compute_advantages(**packed, **kwargs, cu_seqlens=cu, gae_timestep_unit=unit)
        assert_close(pack.advantages, pad.advantages[valid], rtol=1e-5, atol=1e-6)
        assert_close(pack.returns, pad.returns[valid], rtol=1e-5, atol=1e-6)
        for k in pad.stats:
            if k not in ("seq_len", "prompt_len"):
                assert_close(pack.stats[k], pad.stats[k], rtol=1e-5, atol=1e-6, msg=k)
        assert "seq_len" in pack.stats  # packed layout knows its sequence lengths


def test_stats_and_input_errors() -> None:
    mask = torch.tensor([[False, True, True], [False, True, False]])
    res = compute_advantages(
        rewards=torch.tensor([1.0, 0.0]),
        loss_mask=mask,
        no_eos=torch.tensor([False, False]),
        attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
    )
    # seq_len (3 + 2)/2 = 2.5 ; response_len (2 + 1)/2 = 1.5 ; prompt_len 1.0
    assert res.stats["seq_len"] == 2.5 and res.stats["response_len"] == 1.5
    assert res.stats["prompt_len"] == 1.0
    check_stat_names(res.stats)
    with pytest.raises(ValueError, match="kl_ctl=0.1 needs both logprobs and ref_logprobs"):
        compute_advantages(rewards=torch.ones(2), loss_mask=mask, no_eos=torch.zeros(2), kl_ctl=0.1)
    with pytest.raises(ValueError, match=r"rewards must be per-sequence with shape \[2\]"):
        compute_advantages(rewards=torch.ones(3), loss_mask=mask, no_eos=torch.zeros(2))
    with pytest.raises(ValueError, match="values has shape"):
        compute_advantages(
            rewards=torch.ones(2), loss_mask=mask, no_eos=torch.zeros(2), values=torch.zeros(2, 4)
        )
    with pytest.raises(ValueError, match="gae_timestep_unit='turn' needs turn_ids"):
        compute_advantages(
            rewards=torch.ones(2), loss_mask=mask, no_eos=torch.zeros(2), gae_timestep_unit="turn"
        )
