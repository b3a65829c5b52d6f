"""The truncation check: completions cut at max_new_tokens (`no_eos_ratio`) and whether
they grow with training."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from services.doctor.evidence import Evidence

from .base import Check, Status, rounded

NO_EOS_WARN, NO_EOS_FAIL = 0.05, 0.25
"""Recent `no_eos_ratio` above which truncation warns (AReaL's 0.05) / fails."""


def _slope(ys: Sequence[float]) -> float:
    """Least-squares slope of `ys` against their index (per step)."""
    n = len(ys)
    if n < 2:
        return 0.0
    xm = (n - 1) / 2
    ym = statistics.fmean(ys)
    den = sum((i - xm) ** 2 for i in range(n))
    return sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / den


def _corr(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation of two series; None when too short or one is constant."""
    if len(xs) < 3 or len(xs) != len(ys):
        return None
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:  # a constant series
        return None


def no_eos_ratio(ev: Evidence) -> Check:
    """Recent share of completions cut at max_new_tokens (AReaL's 0.05 line, then
    NO_EOS_FAIL), and whether it grows with the sequence length as training goes."""
    name = "no_eos_ratio"
    r = [float(x) for x in ev.series("no_eos_ratio")]
    if not r:
        return Check(name, "n/a", "no no_eos_ratio in the step records", "")
    recent = r[-max(1, len(r) // 3) :]
    seq = ev.stat("seq_len") or ev.stat("response_len")
    max_new = ev.config.gconfig.max_new_tokens if ev.config else None
    nums: dict[str, Any] = {
        "mean": rounded(statistics.fmean(r)),
        "recent_mean": rounded(statistics.fmean(recent)),
        "max": rounded(max(r)),
        "max_new_tokens": max_new,
    }
    if len(seq) == len(r):
        nums["seq_len_first"], nums["seq_len_last"] = rounded(seq[0], 1), rounded(seq[-1], 1)
        nums["seq_len_slope_per_step"] = rounded(_slope(seq))
        nums["corr_with_seq_len"] = rounded(_corr(seq, r), 3)
    summary = (
        f"recent {nums['recent_mean']:.3f}, mean {nums['mean']:.3f}, max {nums['max']:.3f} "
        f"(max_new_tokens {max_new})"
    )
    if "seq_len_slope_per_step" in nums:
        summary += (
            f"; seq_len {nums['seq_len_first']} -> {nums['seq_len_last']} "
            f"({nums['seq_len_slope_per_step']:+.3g}/step)"
        )
    recent_mean = nums["recent_mean"]
    status: Status = (
        "pass" if recent_mean <= NO_EOS_WARN else "warn" if recent_mean <= NO_EOS_FAIL else "fail"
    )
    growing = (
        (nums.get("seq_len_slope_per_step") or 0.0) > 0
        and (nums.get("corr_with_seq_len") or 0.0) > 0.5
        and _slope(r) > 0
    )
    if status == "pass" and growing and recent_mean > NO_EOS_WARN / 2:
        status = "warn"
        advice = (
            "sequences grow and truncation follows them: watch it, raise "
            "gconfig.max_new_tokens before it passes 0.05"
        )
    elif status == "pass":
        advice = "completions end with EOS"
    else:
        advice = (
            f"{recent_mean:.0%} of completions hit max_new_tokens: raise "
            "gconfig.max_new_tokens, or filter long samples (actor.overlong_reward_penalty, "
            "actor.overlong_filtering, dynamic filtering)"
        )
    return Check(name, status, summary, advice, nums)
