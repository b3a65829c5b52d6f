"""Statistics of many micro-batches combine into one value per name (one process)."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.config import PPOActorConfig, RejectionSamplingConfig
from services.common.config.views import ActorLossView
from services.trainer.algorithms.losses import ppo_actor_loss
from services.trainer.algorithms.stats import ACTOR_TOKEN_STATS, summarize_token_stats
from services.trainer.stats_agg import StatAccumulator


def test_token_weighted_means_sums_and_extrema() -> None:
    acc = StatAccumulator()
    acc.add({"task_reward": 1.2, "n_valid_tokens": 30, "staleness_max": 2.0, "staleness_min": 1.0})
    acc.add({"task_reward": 0.8, "n_valid_tokens": 10, "staleness_max": 3.0, "staleness_min": 0.0})
    acc.add({"task_reward": 5.0, "n_valid_tokens": 0})  # no valid tokens: no weight
    out = acc.reduce()
    # (1.2 * 30 + 0.8 * 10) / (30 + 10) = (36 + 8) / 40 = 1.1
    assert out["task_reward"] == pytest.approx(1.1)
    assert out["n_valid_tokens"] == 40.0  # counts add up
    assert out["staleness_max"] == 3.0 and out["staleness_min"] == 0.0
    assert "m2po_masked_fraction" not in out  # never reported: absent, not 0


def test_unknown_names_are_ignored_and_weights_can_be_given() -> None:
    acc = StatAccumulator()
    acc.add({"not_a_stat": 3.0, "rs_filtered_fraction": 0.5}, weight=1.0)
    acc.add({"rs_filtered_fraction": 0.0}, weight=3.0)
    # (0.5 * 1 + 0 * 3) / 4 = 0.125
    assert acc.reduce() == {"rs_filtered_fraction": pytest.approx(0.125)}


def _micro_batch(ratios: list[float], behave_shift: list[float]) -> dict[str, torch.Tensor]:
    prox = torch.full((1, len(ratios)), -1.0)
    logp = prox + torch.log(torch.tensor([ratios]))
    behave = prox - torch.tensor([behave_shift])
    _, stats = ppo_actor_loss(
        logp,
        prox,
        torch.ones(1, len(ratios)),
        torch.ones(1, len(ratios), dtype=torch.bool),
        ActorLossView.of(
            PPOActorConfig(
                use_decoupled_loss=True, rejection_sampling=RejectionSamplingConfig(upper=2.0)
            )
        ),
        behave_logprobs=behave,
    )
    return stats


def test_per_token_statistics_are_avg_min_max_over_every_masked_token() -> None:
    # AReaL's stats tracker (areal/utils/stats_tracker.py, ReduceType.AVG_MIN_MAX) exports
    # <key>/avg = Σ values·mask / Σ mask over every recorded micro-batch, /min, /max.
    # Micro-batch 1: ratios 1.5, 0.5 ; micro-batch 2: ratio 1.0.
    # importance_weight/avg = (1.5 + 0.5 + 1.0) / 3 = 1.0 (a mean of the two micro-batch
    # means would be (1.0 + 1.0)/2 = 1.0 too; the clip ratio tells them apart):
    # clip binds on 1.5 (A>0, > 1.2) -> clip_ratio/avg = 1/3, min 0, max 1.
    # behave_imp_weight π_prox/π_behave = e^shift: e^0.1, e^1.0 (> upper 2: rejected, so out
    # of behave_mask), e^0.2 -> avg (e^0.1 + e^0.2)/2 over the two kept tokens;
    # behave_filtered_ratio/avg = 1/3.
    acc = StatAccumulator()
    for stats in (_micro_batch([1.5, 0.5], [0.1, 1.0]), _micro_batch([1.0], [0.2])):
        acc.add_loss_stats(stats, ACTOR_TOKEN_STATS)
    out = acc.reduce()
    assert out["importance_weight/avg"] == pytest.approx(1.0, rel=0, abs=1e-6)
    assert out["importance_weight/min"] == pytest.approx(0.5, rel=0, abs=1e-6)
    assert out["importance_weight/max"] == pytest.approx(1.5, rel=0, abs=1e-6)
    assert out["clip_ratio/avg"] == pytest.approx(1 / 3, rel=0, abs=1e-6)
    assert (out["clip_ratio/min"], out["clip_ratio/max"]) == (0.0, 1.0)
    w = (math.exp(0.1) + math.exp(0.2)) / 2
    assert out["behave_imp_weight/avg"] == pytest.approx(w, rel=0, abs=1e-6)
    assert out["behave_imp_weight/max"] == pytest.approx(math.exp(0.2), rel=0, abs=1e-6)
    assert out["behave_filtered_ratio/avg"] == pytest.approx(1 / 3, rel=0, abs=1e-6)
    assert out["n_valid_tokens"] == 3.0
    # rs_filtered_fraction: 1/2 and 0/1, weighted by tokens: (0.5*2 + 0*1)/3 = 1/3
    assert out["rs_filtered_fraction"] == pytest.approx(1 / 3, rel=0, abs=1e-6)


def test_one_call_summary_equals_the_accumulator() -> None:
    stats = _micro_batch([1.5, 0.5, 1.1], [0.1, 1.0, -0.3])
    acc = StatAccumulator()
    acc.add_loss_stats(stats, ACTOR_TOKEN_STATS)
    out = acc.reduce()
    for name, value in summarize_token_stats(stats, ACTOR_TOKEN_STATS).items():
        assert out[name] == pytest.approx(float(value), rel=1e-6, abs=1e-7), name


def test_token_counts_add_up_and_the_masked_ratio_is_the_ratio_of_the_sums() -> None:
    # AReaL 2.0 `ppo_actor_loss_fn` per call: masked_token_ratio = 1 - V / max(N, 1).
    # Two calls: N = 10, V = 8 (ratio 0.2) and N = 30, V = 6 (ratio 0.8). The step: N = 40,
    # V = 14, masked 26, ratio 26/40 = 0.65 (weighting by V would give
    # (0.2·8 + 0.8·6)/14 = 0.457; an unweighted mean 0.5).
    acc = StatAccumulator()
    for n, v in ((10.0, 8.0), (30.0, 6.0)):
        acc.add(
            {
                "n_total_tokens": n,
                "n_valid_tokens": v,
                "n_masked_tokens": n - v,
                "masked_token_ratio": 1 - v / n,
            }
        )
    out = acc.reduce()
    assert out["n_total_tokens"] == 40.0 and out["n_valid_tokens"] == 14.0
    assert out["n_masked_tokens"] == 26.0
    assert out["masked_token_ratio"] == pytest.approx(0.65)
    # a call with no loss token still counts its positions: N = 5, V = 0 -> ratio 1
    acc.add({"n_total_tokens": 5.0, "n_valid_tokens": 0.0, "masked_token_ratio": 1.0})
    assert acc.reduce()["masked_token_ratio"] == pytest.approx(31 / 45)
