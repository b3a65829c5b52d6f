"""Rejection sampling (IcePop, KPop, KL metrics, sequence level, clamp) and M2PO."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from services.common.config import RejectionSamplingConfig, load_config
from services.trainer.algorithms.kl import bernoulli_kl, binary_kl_symmetric
from services.trainer.algorithms.offpolicy import (
    apply_rejection_sampling,
    m2po_mask,
)

from ._views import ppo_loss_with

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
ICEPOP = RejectionSamplingConfig(level="token", action="mask", metric="ratio", lower=0.5, upper=5.0)


def _logs(weights: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    behave = torch.full((1, len(weights)), -2.0)
    return behave + torch.log(torch.tensor([weights])), behave


def test_icepop_token_mask_hand_computed() -> None:
    # π_prox/π_behave = [0.4, 1.0, 6.0, 2.0]; IcePop keeps [0.5, 5] -> [F, T, F, T]
    prox, behave = _logs([0.4, 1.0, 6.0, 2.0])
    mask = torch.ones(1, 4, dtype=torch.bool)
    rs = apply_rejection_sampling(prox, behave, mask, ICEPOP)
    assert rs.loss_mask.tolist() == [[False, True, False, True]]
    assert_close(rs.behave_imp_weight, torch.tensor([[0.0, 1.0, 0.0, 2.0]]), rtol=0, atol=1e-6)
    assert_close(rs.filtered_fraction, torch.tensor(0.5), rtol=0, atol=0)


def test_clamp_keeps_tokens_with_truncated_weight() -> None:
    prox, behave = _logs([0.4, 1.0, 6.0, 2.0])
    mask = torch.ones(1, 4, dtype=torch.bool)
    rs = apply_rejection_sampling(
        prox, behave, mask, RejectionSamplingConfig(action="clamp", upper=5.0)
    )
    # lower defaults to 0 for clamp: [0.4, 1, min(6, 5), 2]; one of four changed
    assert rs.loss_mask.tolist() == [[True] * 4]
    assert_close(rs.behave_imp_weight, torch.tensor([[0.4, 1.0, 5.0, 2.0]]), rtol=0, atol=1e-6)
    assert_close(rs.filtered_fraction, torch.tensor(0.25), rtol=0, atol=0)


def test_sequence_level_ratio_uses_geometric_mean() -> None:
    # sequence 0: ratios [2, 8] -> geometric mean 4 > upper 3 -> whole sequence masked
    # sequence 1: ratios [0.5, 2] -> geometric mean 1 -> kept, weight 1 on both tokens
    prox = torch.log(torch.tensor([[2.0, 8.0], [0.5, 2.0]]))
    behave = torch.zeros(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool)
    rs = apply_rejection_sampling(
        prox, behave, mask, RejectionSamplingConfig(level="sequence", upper=3.0)
    )
    assert rs.loss_mask.tolist() == [[False, False], [True, True]]
    assert_close(rs.behave_imp_weight, torch.tensor([[0.0, 0.0], [1.0, 1.0]]), rtol=0, atol=1e-6)
    # agg=max judges by the largest token ratio: max(0.5, 2) = 2 <= 3, max(2, 8) = 8 > 3
    rs = apply_rejection_sampling(
        prox, behave, mask, RejectionSamplingConfig(level="sequence", agg="max", upper=3.0)
    )
    assert rs.loss_mask.tolist() == [[False, False], [True, True]]
    # agg=sum: exp(ln 0.5 + ln 2) = 1 ; exp(ln 2 + ln 8) = 16
    rs = apply_rejection_sampling(
        prox, behave, mask, RejectionSamplingConfig(level="sequence", agg="sum", upper=20.0)
    )
    assert rs.loss_mask.all()


def test_kl_metrics_hand_computed() -> None:
    prox = torch.tensor([[-1.0, -1.0]])
    behave = torch.tensor([[-1.5, -3.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # log r = [0.5, 2.0]; k2 = ½ log r² = [0.125, 2.0] -> upper 1 keeps the first only
    rs = apply_rejection_sampling(
        prox, behave, mask, RejectionSamplingConfig(metric="kl_k2", upper=1.0)
    )
    assert rs.loss_mask.tolist() == [[True, False]]
    # k3 with d = log π_behave - log π_prox = [-0.5, -2]: e^d - 1 - d = [0.1065307, 1.1353353]
    rs = apply_rejection_sampling(
        prox, behave, mask, RejectionSamplingConfig(metric="kl_k3", upper=0.2)
    )
    assert rs.loss_mask.tolist() == [[True, False]]
    # k1 with a lower bound filters negative estimates: log r = [0.5, 2.0] both >= 0.1
    rs = apply_rejection_sampling(
        prox, behave, mask, RejectionSamplingConfig(metric="kl_k1", lower=0.1, upper=1.0)
    )
    assert rs.loss_mask.tolist() == [[True, False]]


def test_binary_kl_hand_computed() -> None:
    p, q = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    # KL(Bern(.5)||Bern(.25)) = .5 ln 2 + .5 ln(.5/.75) = 0.3465736 - 0.2027326 = 0.1438410
    assert_close(bernoulli_kl(p, q), torch.tensor([0.1438410]), rtol=0, atol=1e-6)
    # KL(Bern(.25)||Bern(.5)) = .25 ln .5 + .75 ln 1.5 = -0.1732868 + 0.3040988 = 0.1308120
    assert_close(bernoulli_kl(q, p), torch.tensor([0.1308120]), rtol=0, atol=1e-6)
    assert_close(binary_kl_symmetric(p, q), torch.tensor([0.1438410]), rtol=0, atol=1e-6)
    # edge cases: p = 1 vs q = 0.5 -> ln 2 ; equal probabilities -> 0
    assert_close(
        bernoulli_kl(torch.tensor([0.0]), torch.log(torch.tensor([0.5]))),
        torch.tensor([math.log(2)]),
        rtol=0,
        atol=1e-6,
    )
    assert bernoulli_kl(p, p).item() == 0.0


def test_kpop_runs_end_to_end_in_the_actor_loss() -> None:
    # token 0: p=.5 vs q=.25 -> 0.1438 ; token 1: p = q -> 0; upper 0.14 masks token 0 only
    prox = torch.log(torch.tensor([[0.5, 0.3]]))
    behave = torch.log(torch.tensor([[0.25, 0.3]]))
    logp = prox.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    kpop = RejectionSamplingConfig(metric="binary_kl", upper=0.14)
    loss, stats = ppo_loss_with(
        logp,
        prox,
        adv,
        mask,
        behave_logprobs=behave,
        use_decoupled_loss=True,
        rejection_sampling=kpop,
    )
    # token 1 survives with weight 1 and loss -1; the denominator keeps both tokens: -1/2
    assert_close(loss, torch.tensor(-0.5), rtol=0, atol=1e-6)
    assert_close(stats["rs_filtered_fraction"], torch.tensor(0.5), rtol=0, atol=0)
    loss.backward()
    assert logp.grad is not None and logp.grad[0, 0] == 0.0
    kpop_preset = load_config(EXAMPLES / "kpop.yaml").actor.rejection_sampling
    assert kpop_preset is not None
    assert kpop_preset.metric == "binary_kl" and kpop_preset.upper == 2.0


def test_spec_validation_names_the_field() -> None:
    # the schema checks the spec once, at load (`RejectionSamplingConfig`)
    with pytest.raises(ValueError, match="only works with metric 'ratio'"):
        RejectionSamplingConfig(action="clamp", metric="kl_k2")
    with pytest.raises(ValueError, match="upper bound must be > 1"):
        RejectionSamplingConfig(upper=0.9)
    with pytest.raises(ValueError, match="lower bound exceeds upper"):
        RejectionSamplingConfig(lower=3.0, upper=2.0)
    with pytest.raises(ValueError, match="metric"):
        RejectionSamplingConfig(metric="tv")  # type: ignore[arg-type]
    # clamp with lower = 0 (what the config fills in) is valid
    RejectionSamplingConfig(action="clamp", lower=0.0, upper=2.0)


def test_m2po_hand_computed() -> None:
    # log r = [0.1, 0.2, 1.0, 0.3] -> M2 = [0.01, 0.04, 1.0, 0.09], mean 0.285
    # sorted running means [0.01, 0.025, 0.0466667, 0.285] -> threshold 0.05 keeps 3 tokens
    log_ratio = torch.tensor([[0.1, 0.2, 1.0, 0.3]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    new, stats = m2po_mask(log_ratio, mask, 0.05)
    assert new.tolist() == [[True, True, False, True]]
    assert_close(stats["m2po_second_moment"], torch.tensor(0.285), rtol=0, atol=1e-6)
    assert_close(stats["m2po_masked_fraction"], torch.tensor(0.25), rtol=0, atol=0)
    # a threshold above the mean keeps everything; masked positions stay masked
    new, stats = m2po_mask(log_ratio, torch.tensor([[True, True, False, True]]), 1.0)
    assert new.tolist() == [[True, True, False, True]] and stats["m2po_masked_fraction"] == 0


def test_m2po_matches_greedy_removal(gen: torch.Generator) -> None:
    log_ratio = torch.randn(4, 25, generator=gen) * 0.3
    mask = torch.rand(4, 25, generator=gen) < 0.8
    new, _ = m2po_mask(log_ratio, mask, 0.02)
    # greedy oracle (AReaL's `_get_m2po_loss_mask`, areal/trainer/ppo/actor.py): drop the
    # largest M2 until the mean of the rest is strictly below the threshold, keep >= 1
    kept = sorted(
        ((float(x) ** 2, i) for i, x in enumerate(log_ratio[mask].tolist())), reverse=True
    )
    while len(kept) > 1 and sum(m for m, _ in kept) / len(kept) >= 0.02:
        kept.pop(0)
    assert int(new.sum()) == len(kept)
    assert bool((new & ~mask).sum() == 0)


def test_m2po_in_the_actor_loss_uses_prox_versus_behave() -> None:
    # log π_prox - log π_behave = [0.1, 0.2, 1.0, 0.3] (as above); π_θ = π_prox.
    prox = torch.zeros(1, 4)
    behave = -torch.tensor([[0.1, 0.2, 1.0, 0.3]])
    logp = prox.clone().requires_grad_(True)
    adv = torch.ones(1, 4)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, stats = ppo_loss_with(logp, prox, adv, mask, behave_logprobs=behave, m2_threshold=0.05)
    # token 2 is masked; AReaL (`grpo_loss_fn` masks before `ppo_actor_loss_fn`, which divides
    # by the count of the mask it receives): three tokens of loss -1 over 3 kept: -1
    assert_close(loss, torch.tensor(-1.0), rtol=0, atol=1e-6)
    assert_close(stats["m2po_masked_fraction"], torch.tensor(0.25), rtol=0, atol=0)
    loss.backward()
    assert logp.grad is not None and logp.grad[0, 2] == 0.0
    with pytest.raises(ValueError, match="M2PO. needs behave_logprobs"):
        ppo_loss_with(logp, prox, adv, mask, m2_threshold=0.05)


def test_m2po_keeps_the_single_smallest_token_when_no_cut_qualifies() -> None:
    # AReaL `_get_m2po_loss_mask` (areal/trainer/ppo/actor.py): sorted descending
    # M2 = [4, 1]; suffix means [2.5, 1]; none < 0.5 -> mask n - 1 tokens, keep the smallest.
    new, stats = m2po_mask(torch.tensor([[1.0, 2.0]]), torch.ones(1, 2, dtype=torch.bool), 0.5)
    assert new.tolist() == [[True, False]]
    assert_close(stats["m2po_masked_fraction"], torch.tensor(0.5), rtol=0, atol=0)


def test_m2po_threshold_is_strict() -> None:
    # AReaL keeps a suffix only while its mean is < threshold. log r = [0.5, 1.5]:
    # M2 = [0.25, 2.25] (exact in binary), mean of both 1.25; threshold 1.25 -> the pair
    # does not qualify, the smallest alone (0.25 < 1.25) does.
    log_ratio, mask = torch.tensor([[0.5, 1.5]]), torch.ones(1, 2, dtype=torch.bool)
    assert m2po_mask(log_ratio, mask, 1.25)[0].tolist() == [[True, False]]
    assert m2po_mask(log_ratio, mask, 1.2500001)[0].tolist() == [[True, True]]


def test_m2po_denominator_with_a_minibatch_normalizer() -> None:
    # AReaL: each micro-batch's loss is Σ kept / (its post-M2PO count), weighted by
    # (its pre-M2PO count) / (the minibatch's). One micro-batch of 4 tokens (3 kept,
    # loss -1 each) in a minibatch of 8: (-3 / 3) x 4 / 8 = -0.5.
    prox = torch.zeros(1, 4)
    behave = -torch.tensor([[0.1, 0.2, 1.0, 0.3]])
    logp = prox.clone().requires_grad_(True)
    adv, mask = torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool)
    loss, _ = ppo_loss_with(
        logp, prox, adv, mask, behave_logprobs=behave, m2_threshold=0.05, normalizer=8.0
    )
    assert_close(loss, torch.tensor(-0.5), rtol=0, atol=1e-6)


def test_m2po_runs_before_rejection_sampling() -> None:
    # AReaL `grpo_loss_fn` masks with M2PO, then `ppo_actor_loss_fn` applies rejection
    # sampling to that mask. log π_prox/π_behave = [0.1, 0.2, 1.0, 0.3]: M2PO (0.05)
    # drops token 2, whose weight e^1 = 2.718 would also exceed upper 2: rejection
    # sampling then has nothing left to filter (filtered_fraction 0, not 1/4).
    prox = torch.zeros(1, 4)
    behave = -torch.tensor([[0.1, 0.2, 1.0, 0.3]])
    logp = prox.clone().requires_grad_(True)
    adv, mask = torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool)
    _, stats = ppo_loss_with(
        logp,
        prox,
        adv,
        mask,
        behave_logprobs=behave,
        use_decoupled_loss=True,
        rejection_sampling=RejectionSamplingConfig(upper=2.0),
        m2_threshold=0.05,
    )
    assert_close(stats["m2po_masked_fraction"], torch.tensor(0.25), rtol=0, atol=0)
    assert_close(stats["filtered_fraction"], torch.tensor(0.0), rtol=0, atol=0)
    assert stats["loss_mask"].tolist() == [[True, True, False, True]]  # statistics mask


def test_binary_kl_lower_bound_applies_as_in_areal() -> None:
    # AReaL `apply_rejection_sampling` -> `_check_bounds`: lower <= metric <= upper for every
    # metric, binary_kl included. Token 0: p = .5, q = .25: KL(P||Q) = .5 ln 2 + .5 ln(.5/.75)
    # = 0.1438410, reverse .25 ln .5 + .75 ln 1.5 = 0.1308120, max 0.1438410; token 1: p = q
    # -> 0. With lower 0.01 and upper 2 token 1 is rejected and token 0 kept.
    prox = torch.log(torch.tensor([[0.5, 0.3]]))
    behave = torch.log(torch.tensor([[0.25, 0.3]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    spec = RejectionSamplingConfig(metric="binary_kl", lower=0.01, upper=2.0)
    res = apply_rejection_sampling(prox, behave, mask, spec)
    assert res.loss_mask.tolist() == [[True, False]]
    assert_close(res.filtered_fraction, torch.tensor(0.5), rtol=0, atol=0)
    assert_close(
        binary_kl_symmetric(prox, behave)[0, 0], torch.tensor(0.1438410), rtol=0, atol=1e-6
    )
