"""`ci95`: Student's t quantiles and the interval over seeds.

Reference: the t distribution's density, f(t) = Γ((ν+1)/2) / (√(νπ) Γ(ν/2)) · (1 + t²/ν)^(-(ν+1)/2),
integrated numerically here: each tabulated quantile must leave 2.5 % in the upper tail.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from ci95 import T975, mean_ci, t975  # noqa: E402


def upper_tail(q: float, df: int, steps: int = 200_000) -> float:
    """P(T > q) by the substitution t = q / u (u in (0, 1]) and the midpoint rule."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    total = 0.0
    for i in range(steps):
        u = (i + 0.5) / steps
        t = q / u
        total += c * (1 + t * t / df) ** (-(df + 1) / 2) * q / (u * u)
    return total / steps


@pytest.mark.parametrize("df", sorted(T975))
def test_each_quantile_leaves_two_and_a_half_percent(df: int) -> None:
    assert upper_tail(T975[df], df) == pytest.approx(0.025, abs=2e-4)


def test_untabulated_df_takes_the_wider_neighbour_and_large_df_the_normal() -> None:
    assert t975(22) == T975[20]
    assert t975(31) == 1.96
    with pytest.raises(ValueError, match="at least 2"):
        t975(0)


def test_interval_of_three_seeds() -> None:
    # mean 0.5; sample sd of (0.4, 0.5, 0.6) = 0.1; half = 4.303 * 0.1 / sqrt(3) = 0.24843
    ci = mean_ci([0.4, 0.5, 0.6])
    assert ci["n"] == 3
    assert ci["mean"] == pytest.approx(0.5)
    assert ci["half_width"] == pytest.approx(0.248434, abs=1e-6)
    assert (ci["low"], ci["high"]) == pytest.approx((0.251566, 0.748434), abs=1e-6)


def test_one_value_has_no_interval() -> None:
    assert mean_ci([0.7]) == {"n": 1, "mean": 0.7, "half_width": None, "low": None, "high": None}
    assert mean_ci([])["mean"] is None
