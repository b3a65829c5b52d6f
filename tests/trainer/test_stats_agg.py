"""Statistics of many micro-batches combine into token-weighted means (one process)."""

from __future__ import annotations

import pytest

from services.trainer.stats_agg import StatAccumulator


def test_token_weighted_means_sums_and_extrema() -> None:
    acc = StatAccumulator()
    acc.add(
        {"importance_weight": 1.2, "n_valid_tokens": 30, "staleness_max": 2.0, "staleness_min": 1.0}
    )
    acc.add(
        {"importance_weight": 0.8, "n_valid_tokens": 10, "staleness_max": 3.0, "staleness_min": 0.0}
    )
    acc.add({"importance_weight": 5.0, "n_valid_tokens": 0})  # no valid tokens: no weight
    out = acc.reduce()
    # (1.2 * 30 + 0.8 * 10) / (30 + 10) = (36 + 8) / 40 = 1.1
    assert out["importance_weight"] == pytest.approx(1.1)
    assert out["n_valid_tokens"] == 40.0  # counts add up
    assert out["staleness_max"] == 3.0 and out["staleness_min"] == 0.0
    assert "approx_kl" not in out  # never reported: absent, not 0


def test_unknown_names_are_ignored_and_weights_can_be_given() -> None:
    acc = StatAccumulator()
    acc.add({"not_a_stat": 3.0, "clip_ratio": 0.5}, weight=1.0)
    acc.add({"clip_ratio": 0.0}, weight=3.0)
    # (0.5 * 1 + 0 * 3) / 4 = 0.125
    assert acc.reduce() == {"clip_ratio": pytest.approx(0.125)}
