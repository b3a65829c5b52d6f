"""Means with two-sided 95 % confidence intervals over a few seeds (Student's t).

A benchmark with 3 to 10 seeds cannot use the normal 1.96: with 3 seeds the interval is
t(0.975, 2) = 4.303 standard errors wide on each side. The quantiles below are Student's
t distribution's, df = n - 1 (any statistics table; `tests/benchmarks/test_ci95.py` checks
each against a numerical integration of the t density).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

T975: dict[int, float] = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    25: 2.060,
    30: 2.042,
}
"""t(0.975, df): the upper 2.5 % point of Student's t with df degrees of freedom."""


def t975(df: int) -> float:
    """t(0.975, df); between tabulated values the next smaller df (a wider interval),
    beyond 30 the normal 1.96."""
    if df < 1:
        raise ValueError(f"df={df}: a confidence interval needs at least 2 values")
    if df > 30:
        return 1.96
    return T975[max(d for d in T975 if d <= df)]


def mean_ci(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean, 95 % half-width and bounds of `values` (t interval over n - 1 df). With one
    value the interval is unknown (None)."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": None, "half_width": None, "low": None, "high": None}
    mean = statistics.fmean(xs)
    if n == 1:
        return {"n": 1, "mean": mean, "half_width": None, "low": None, "high": None}
    half = t975(n - 1) * statistics.stdev(xs) / math.sqrt(n)
    return {"n": n, "mean": mean, "half_width": half, "low": mean - half, "high": mean + half}
