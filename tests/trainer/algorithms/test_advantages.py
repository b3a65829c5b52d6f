"""The rewards → advantages pipeline: shaping, KL, truncation flag, GAE modes, norms."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from services.trainer.algorithms.layout import padded_to_packed
from services.trainer.algorithms.rewards import overlong_penalty, shape_rewards
from services.trainer.algorithms.stats import check_stat_names

from ._views import advantages_with, norm


def _kl_case(estimator: str) -> torch.Tensor:
    res = advantages_with(
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
    tok = advantages_with(**kwargs, gae_timestep_unit="token")
    # token mode: A_t = 1 + Σ_{t' >= t} kl_t' = [0, 0.1, 0.3, 0.6]
    assert_close(tok.advantages, torch.tensor([[0.0, 0.1, 0.3, 0.6]]), rtol=0, atol=1e-6)
    turn = advantages_with(**kwargs, gae_timestep_unit="turn")
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
    res = advantages_with(
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
    with pytest.raises(ValueError, match="needs overlong_tokens"):
        advantages_with(
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
    res = advantages_with(
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
        advantages_with(
            rewards=torch.zeros(2),
            loss_mask=mask,
            no_eos=torch.tensor([False, True]),
            values=values,
        )


# Truncated completions. `mask_no_eos_with_zero` is AReaL 2.0's option: reference values
# follow `PPOActor._compute_advantages` (areal/trainer/ppo/actor.py, commit cbff54d):
#
#     reward_score = reward_norm(clip((r + bias) * scaling), group_sizes)
#     gae_outcome_rewards[i, seqlens-2] = where(seq_no_eos_mask, 0, reward_score)
#     rewards = gae_kl_rewards + gae_outcome_rewards   (KL kept for every sequence)
#     advantages, returns = _compute_token_level_gae(...); adv_norm(advantages, loss_mask)
#     data["loss_mask"] = the loss mask, unchanged
#
# AReaL's tensors are rolled left by one (position t predicts token t+1; `values[:, t]` is
# V after token t, `values[:, -1] * seq_no_eos_mask` the bootstrap), Flywheel's are
# token-aligned, so AReaL's position t is Flywheel's token t+1. AReaL takes
# `seq_no_eos_mask` from `seqlens == width`; the cases make the truncated rows the only
# full-width ones, so that test and the `no_eos` flag agree.


def _truncation_case_a(**options: object):
    # rows: [prompt, a, b, pad] (EOS) and [prompt, c, d, e] (truncated), outcome r = [1, 2]
    return advantages_with(
        rewards=torch.tensor([1.0, 2.0]),
        loss_mask=torch.tensor([[False, True, True, False], [False, True, True, True]]),
        no_eos=torch.tensor([False, True]),
        logprobs=torch.tensor([[0.0, -1.0, -0.5, 0.0], [0.0, -2.0, -0.3, -1.5]]),
        ref_logprobs=torch.tensor([[0.0, -1.2, -0.5, 0.0], [0.0, -1.0, -0.4, -1.0]]),
        values=torch.tensor([[0.0, 0.5, 0.4, 0.0], [0.0, 0.2, 0.3, 0.1]]),
        bootstrap_values=torch.tensor([9.0, 0.6]),
        kl_ctl=0.1,
        discount=0.9,
        gae_lambda=0.8,
        **options,  # type: ignore[arg-type]
    )


def test_mask_no_eos_with_zero_with_values_follows_areal() -> None:
    # k1 KL reward -0.1 (log π_old - log π_ref): a -0.02, b 0 ; c 0.1, d -0.01, e 0.05.
    # γλ = 0.72. Row 0 (EOS, bootstrap ignored): outcome 1 on b.
    #   b: δ = 1 + 0 - 0.4 = 0.6 = A ; G = 1.0
    #   a: δ = -0.02 + 0.9·0.4 - 0.5 = -0.16 ; A = -0.16 + 0.72·0.6 = 0.272 ; G = 0.772
    # Row 1 (truncated): AReaL puts 0 instead of 2 on e, keeps the KL rewards, and
    # bootstraps with V = 0.6 (`nextvalues = values[:, -1] * seq_no_eos_mask`).
    #   e: δ = 0.05 + 0.9·0.6 - 0.1 = 0.49 = A ; G = 0.59
    #   d: δ = -0.01 + 0.9·0.1 - 0.3 = -0.22 ; A = -0.22 + 0.72·0.49 = 0.1328 ; G = 0.4328
    #   c: δ = 0.1 + 0.9·0.3 - 0.2 = 0.17 ; A = 0.17 + 0.72·0.1328 = 0.265616 ; G = 0.465616
    res = _truncation_case_a(mask_no_eos_with_zero=True)
    adv = torch.tensor([[0.0, 0.272, 0.6, 0.0], [0.0, 0.265616, 0.1328, 0.49]])
    ret = torch.tensor([[0.0, 0.772, 1.0, 0.0], [0.0, 0.465616, 0.4328, 0.59]])
    assert_close(res.advantages, adv, rtol=0, atol=1e-6)
    assert_close(res.returns, ret, rtol=0, atol=1e-6)
    # the truncated row keeps its tokens in the loss (and in the critic's targets)
    assert res.loss_mask.tolist() == [[False, True, True, False], [False, True, True, True]]
    assert_close(res.rewards, torch.tensor([1.0, 0.0]), rtol=0, atol=0)
    # without the option, e gets 2 + 0.05: A_e = 2.49 ; A_d = -0.22 + 0.72·2.49 = 1.5728 ;
    # A_c = 0.17 + 0.72·1.5728 = 1.302416 (row 0 unchanged)
    off = _truncation_case_a()
    assert_close(off.advantages[1], torch.tensor([0.0, 1.302416, 1.5728, 2.49]), rtol=0, atol=1e-6)
    assert_close(off.advantages[0], adv[0], rtol=0, atol=1e-6)


def test_mask_no_eos_with_zero_with_grpo_group_norm_follows_areal() -> None:
    # Groups of 4 and 2 (AReaL: `group_sizes` [4, 2]); rows 3 and 5 are truncated. Group
    # mean/std (unbiased, eps 1e-5) over every reward, then the truncated ones are set to 0.
    #   g0 = [1, 0, 1, 1]: mean 0.75, std = sqrt((3·0.25² + 0.75²)/3) = 0.5
    #        -> [0.25, -0.75, 0.25, 0.25]/0.50001 = [0.49999, -1.49997, 0.49999, (0)]
    #   g1 = [0, 1]: mean 0.5, std = sqrt(2·0.25/1) = 0.7071068
    #        -> [-0.5, 0.5]/0.7071168 = [-0.7070968, (0)]
    # γ = λ = 1, no critic, no KL: each generated token's advantage is its row's reward.
    no_eos = torch.tensor([False, False, False, True, False, True])
    mask = torch.zeros(6, 4, dtype=torch.bool)
    mask[:, 1:3] = True
    mask[no_eos, 3] = True  # the truncated rows fill the width

    def grpo(**option: bool):
        return advantages_with(
            rewards=torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
            loss_mask=mask,
            no_eos=no_eos,
            group_ids=["g0", "g0", "g0", "g0", "g1", "g1"],
            reward_norm=norm("group", False, "group"),
            **option,
        )

    res = grpo(mask_no_eos_with_zero=True)
    per_seq = torch.tensor([0.49999, -1.49997, 0.49999, 0.0, -0.7070968, 0.0])
    assert_close(res.rewards, per_seq, rtol=0, atol=1e-6)
    assert_close(res.advantages, torch.where(mask, per_seq.unsqueeze(1), 0.0), rtol=0, atol=1e-6)
    assert_close(res.loss_mask, mask, rtol=0, atol=0)
    # without the option the truncated rows keep 0.49999 and 0.7070968: the statistics of
    # the other rows are the same, because AReaL normalises before zeroing
    off = grpo()
    expected_off = torch.tensor([0.49999, -1.49997, 0.49999, 0.49999, -0.7070968, 0.7070968])
    assert_close(off.rewards, expected_off, rtol=0, atol=1e-6)


def _every_option(**options: object):
    # Three rows of one group, width 5: [p, g, g, pad, pad] (EOS), [p, g, g, g, pad] (EOS),
    # [p, g, g, g, g] (truncated). π_old = -1 on generated tokens; log π_old - log π_ref =
    # 0.5 on row 1's first token, -0.5 on row 2's third, 0 elsewhere.
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 1:3] = mask[1, 1:4] = mask[2, 1:5] = True
    old = torch.where(mask, -1.0, 0.0)
    d = torch.zeros(3, 5)
    d[1, 1], d[2, 3] = 0.5, -0.5
    values = torch.zeros(3, 5)
    values[0, 1:3] = torch.tensor([0.1, 0.2])
    values[1, 1:4] = torch.tensor([0.3, 0.1, 0.2])
    values[2, 1:5] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    return advantages_with(
        rewards=torch.tensor([1.0, 1.0, 3.0]),
        loss_mask=mask,
        no_eos=torch.tensor([False, False, True]),
        logprobs=old,
        ref_logprobs=old - d,
        values=values,
        bootstrap_values=torch.tensor([7.0, 7.0, 0.5]),
        group_ids=[0, 0, 0],
        overlong_reward_penalty=True,
        overlong_tokens=2,
        overlong_penalty_factor=1.0,
        max_new_tokens=4,
        reward_bias=0.5,
        reward_scaling=2.0,
        reward_clip=4.0,
        reward_norm=norm("group", False, "group"),
        kl_ctl=0.2,
        kl_estimator="k3",
        discount=0.9,
        gae_lambda=0.95,
        adv_norm=norm("batch", False, "batch"),
        **options,  # type: ignore[arg-type]
    )


def test_mask_no_eos_with_zero_with_every_option_follows_areal() -> None:
    # AReaL's order, step by step (areal/trainer/ppo/actor.py `_compute_advantages` and
    # areal/utils/functional/functional.py `reward_overlong_penalty`, cbff54d):
    # 1. overlong penalty, L_exp = 4 - 2 = 2: min(-(L - 2)/2 · 1, 0) for L = 2, 3, 4
    #    = [0, -0.5, -1] -> r = [1, 0.5, 2]
    # 2. (r + 0.5) · 2 = [3, 2, 5], clip ±4 -> [3, 2, 4]
    # 3. group norm: mean 3, unbiased std sqrt((0 + 1 + 1)/2) = 1 -> [0, -0.99999, 0.99999]
    # 4. truncated row 2 -> 0: outcome rewards [0, -0.99999, 0]
    # 5. k3 KL reward -0.2·(e^{-d} - 1 + d): d = 0.5 -> -0.2·0.1065307 = -0.0213061 ;
    #    d = -0.5 -> -0.2·0.1487213 = -0.0297443 (row 2 keeps it)
    # 6. GAE, γ = 0.9, γλ = 0.855:
    #    row 0: A = [0.08 + 0.855·(-0.2), -0.2] = [-0.091, -0.2] ; G = [0.009, 0]
    #    row 1: A_3 = -0.99999 - 0.2 = -1.19999 ; A_2 = 0.08 + 0.855·A_3 = -0.9459915 ;
    #           A_1 = -0.0213061 + 0.09 - 0.3 + 0.855·A_2 = -1.0401288 ; G = A + V
    #    row 2 (bootstrap 0.5): A_4 = 0.45 - 0.1 = 0.35 ; A_3 = -0.0297443 + 0.09 - 0.2
    #           + 0.855·0.35 = 0.1595058 ; A_2 = -0.12 + 0.855·A_3 = 0.0163775 ;
    #           A_1 = -0.13 + 0.855·A_2 = -0.1159973
    # 7. adv_norm over the 9 tokens: mean -0.3408027, unbiased std 0.5680418,
    #    A' = (A - mean)/(std + 1e-5)
    res = _every_option(mask_no_eos_with_zero=True)
    adv = torch.tensor(
        [
            [0.0, 0.4397534, 0.2478695, 0.0, 0.0],
            [0.0, -1.2310957, -1.0653760, -1.5125155, 0.0],
            [0.0, 0.3957481, 0.6287809, 0.8807444, 1.2160910],
        ]
    )
    ret = torch.tensor(
        [
            [0.0, 0.009, 0.0, 0.0, 0.0],
            [0.0, -0.7401289, -0.8459916, -0.99999, 0.0],
            [0.0, 0.2840027, 0.3163774, 0.3595058, 0.45],
        ]
    )
    assert_close(res.advantages, adv, rtol=0, atol=2e-6)
    assert_close(res.returns, ret, rtol=0, atol=2e-6)
    assert int(res.loss_mask.sum()) == 9  # nothing leaves the loss
    assert_close(res.rewards, torch.tensor([0.0, -0.99999, 0.0]), rtol=0, atol=1e-6)
    # without the option row 2 keeps 0.99999 on its last token: A_4 = 1.34999, ... and
    # adv_norm moves every row (AReaL's numbers for that run: row 0 [-0.1132981, -0.2287385])
    off = _every_option()
    assert_close(off.advantages[0, 1:3], torch.tensor([-0.1132981, -0.2287385]), rtol=0, atol=2e-6)
    assert_close(off.returns[2, 4], torch.tensor(1.44999), rtol=0, atol=2e-6)


def _one_group_of_three(**option: bool):
    # rewards [1, 0, 5], the last row truncated; group mean (no std), γ = λ = 1
    return advantages_with(
        rewards=torch.tensor([1.0, 0.0, 5.0]),
        loss_mask=torch.ones(3, 2, dtype=torch.bool),
        no_eos=torch.tensor([False, False, True]),
        group_ids=[0, 0, 0],
        reward_norm=norm("group", False, None),
        **option,
    )


def test_overlong_filtering_removes_truncated_sequences() -> None:
    # DAPO's overlong filtering (Flywheel's `overlong_filtering`): the truncated row leaves
    # the loss and the group statistics: mean of [1, 0] = 0.5 -> [0.5, -0.5]; its reward
    # is reported as 0
    res = _one_group_of_three(overlong_filtering=True)
    assert res.loss_mask.tolist() == [[True, True], [True, True], [False, False]]
    assert_close(res.rewards, torch.tensor([0.5, -0.5, 0.0]), rtol=0, atol=1e-6)
    assert_close(res.advantages[2], torch.zeros(2), rtol=0, atol=0)
    # the AReaL option on the same batch: mean of [1, 0, 5] = 2 -> [-1, -2, (3 -> 0)], and
    # the truncated row stays in the loss with advantage 0
    areal = _one_group_of_three(mask_no_eos_with_zero=True)
    assert areal.loss_mask.tolist() == [[True, True]] * 3
    assert_close(areal.rewards, torch.tensor([-1.0, -2.0, 0.0]), rtol=0, atol=1e-6)


def test_the_two_truncation_options_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="set one of the two"):
        advantages_with(
            rewards=torch.zeros(1),
            loss_mask=torch.ones(1, 2, dtype=torch.bool),
            no_eos=torch.tensor([True]),
            mask_no_eos_with_zero=True,
            overlong_filtering=True,
        )


def test_grpo_pipeline_with_unequal_groups_hand_computed() -> None:
    # groups p1 = [1, 0, 0], p2 = [1, 1] (unequal after filtering); group mean/std norm,
    # then γ = λ = 1 broadcasts each normalised reward over its tokens.
    lengths = [2, 3, 1, 2, 4]
    mask = torch.zeros(5, 4, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    res = advantages_with(
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0]),
        loss_mask=mask,
        no_eos=torch.zeros(5, dtype=torch.bool),
        group_ids=["p1", "p1", "p1", "p2", "p2"],
        reward_norm=norm("group", False, "group"),
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
    res = advantages_with(
        rewards=torch.tensor([1.0, 0.0, 0.0]),
        loss_mask=mask,
        no_eos=torch.zeros(3, dtype=torch.bool),
        group_ids=[0, 0, 0],
        reward_norm=norm("group", False, None),
        adv_norm=norm("batch", False, "batch"),
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
    res = advantages_with(rewards=torch.tensor([1.0]), loss_mask=mask, no_eos=torch.tensor([False]))
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
        reward_norm=norm("group", True, None),
        adv_norm=norm("batch", False, "batch"),
    )
    per_token = {
        "loss_mask": mask,
        "logprobs": torch.randn(b, t, generator=gen) - 1,
        "ref_logprobs": torch.randn(b, t, generator=gen) - 1,
        "values": torch.randn(b, t, generator=gen),
        "turn_ids": turn,
    }
    for unit in ("token", "turn"):
        pad = advantages_with(**per_token, **kwargs, gae_timestep_unit=unit)
        cu = padded_to_packed(mask, lengths)[1]
        packed = {k: padded_to_packed(v, lengths)[0] for k, v in per_token.items()}
        pack = advantages_with(**packed, **kwargs, cu_seqlens=cu, gae_timestep_unit=unit)
        assert_close(pack.advantages, pad.advantages[valid], rtol=1e-5, atol=1e-6)
        assert_close(pack.returns, pad.returns[valid], rtol=1e-5, atol=1e-6)
        for k in pad.stats:
            if k not in ("seq_len", "prompt_len"):
                assert_close(pack.stats[k], pad.stats[k], rtol=1e-5, atol=1e-6, msg=k)
        assert "seq_len" in pack.stats  # packed layout knows its sequence lengths


def test_stats_and_input_errors() -> None:
    mask = torch.tensor([[False, True, True], [False, True, False]])
    res = advantages_with(
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
        advantages_with(rewards=torch.ones(2), loss_mask=mask, no_eos=torch.zeros(2), kl_ctl=0.1)
    with pytest.raises(ValueError, match=r"rewards must be per-sequence with shape \[2\]"):
        advantages_with(rewards=torch.ones(3), loss_mask=mask, no_eos=torch.zeros(2))
    with pytest.raises(ValueError, match="values has shape"):
        advantages_with(
            rewards=torch.ones(2), loss_mask=mask, no_eos=torch.zeros(2), values=torch.zeros(2, 4)
        )
    with pytest.raises(ValueError, match="gae_timestep_unit='turn' needs turn_ids"):
        advantages_with(
            rewards=torch.ones(2), loss_mask=mask, no_eos=torch.zeros(2), gae_timestep_unit="turn"
        )
