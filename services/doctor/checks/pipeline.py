"""Checks of the data path between the services: staleness against eta, groups dropped by
the buffer, a trainer starved of batches, restarts and weight syncs."""

from __future__ import annotations

import statistics
from typing import Any

from services.doctor.evidence import Evidence, sum_by

from .base import Check, Status, rounded, worst

STALE_WARN, STALE_FAIL = 0.1, 0.5
FILTERED_WARN, FILTERED_FAIL = 0.8, 0.95
"""Shares of the groups put that were dropped as stale / filtered out (a filter keeping one
group in five makes the rollout generate five times what is trained)."""
BUFFER_DECISIONS = frozenset({"filtered", "stale", "stale_at_put", "stale_at_claim", "duplicate"})
"""Reasons of `flywheel_rollout_groups_rejected_total` that repeat the buffer's own count."""
WAIT_WARN = 0.9
"""Share of the trainer's time spent waiting for a batch above which it warns."""


def staleness(ev: Evidence) -> Check:
    """No trained token older than eta allows (v - v_behave <= eta): a breach means
    the buffer's admission is broken."""
    name = "staleness"
    worst = [float(x) for x in ev.series("staleness_max")]
    if not worst:
        return Check(name, "n/a", "no staleness in the step records", "")
    eta: int | None = (
        ev.config.rollout.max_head_offpolicyness if ev.config else (ev.summary or {}).get("eta")
    )
    mean = statistics.fmean(float(x) for x in ev.series("staleness_avg") or [0.0])
    nums = {"max": max(worst), "mean": rounded(mean, 3), "eta": eta}
    summary = f"max v - v_behave {max(worst):g}, mean {mean:.2f}, eta {eta}"
    if eta is None:
        return Check(name, "n/a", summary + " (eta unknown: no config)", "", nums)
    if max(worst) > eta:
        return Check(
            name,
            "fail",
            summary,
            "the trainer saw tokens older than eta allows: the buffer's admission is broken "
            "(report it with the buffer's log)",
            nums,
        )
    advice = (
        "synchronous (eta 0): every token from the current policy"
        if eta == 0
        else f"within eta; off-policyness costs are in behave_imp_weight (eta {eta})"
    )
    return Check(name, "pass", summary, advice, nums)


def _ledger(ev: Evidence) -> tuple[dict[str, float], float] | None:
    """Groups dropped by reason, and groups put, from summary.json or a live scrape."""
    if ev.summary and isinstance(ev.summary.get("buffer"), dict) and ev.summary["buffer"]:
        b = ev.summary["buffer"]
        dropped = {k: float(v) for k, v in (b.get("dropped_total") or {}).items()}
        return dropped, float(b.get("put_total", 0) or 0)
    buf = ev.samples("buffer")
    if buf:
        dropped = sum_by(buf, "flywheel_buffer_dropped_groups_total", "reason")
        put = sum(sum_by(buf, "flywheel_buffer_put_groups_total").values())
        return dropped, put
    return None


def dropped_groups(ev: Evidence) -> Check:
    """Shares of the groups put that the buffer dropped as stale (STALE_*) or
    filtered out (FILTERED_*), and any dropped as invalid."""
    name = "dropped_groups"
    ledger = _ledger(ev)
    if ledger is None:
        return Check(name, "n/a", "no buffer ledger (no summary.json, buffer not scraped)", "")
    dropped, put = ledger
    # The rollout counts the buffer's refusals too (reason = the buffer's decision): only
    # the groups that never reached the buffer are its own.
    rejected = {
        k: v
        for k, v in sum_by(
            ev.samples("rollout"), "flywheel_rollout_groups_rejected_total", "reason"
        ).items()
        if k not in BUFFER_DECISIONS and v > 0
    }
    stale = sum(v for k, v in dropped.items() if k.startswith("stale"))
    filtered = dropped.get("filtered", 0.0)
    invalid = dropped.get("invalid", 0.0)
    total = max(put, 1.0)
    nums = {
        "put": put,
        "dropped": dropped,
        "not_put_by_rollout": rejected,
        "stale_fraction": rounded(stale / total),
        "filtered_fraction": rounded(filtered / total),
        "invalid": invalid,
    }
    summary = (
        f"{put:g} groups put; stale {stale:g} ({stale / total:.1%}), filtered {filtered:g} "
        f"({filtered / total:.1%}), invalid {invalid:g}"
    )
    if rejected:
        summary += "; never put: " + ", ".join(f"{k} {v:g}" for k, v in sorted(rejected.items()))
    sf, ff = stale / total, filtered / total
    s_stale: Status = "pass" if sf <= STALE_WARN else "warn" if sf <= STALE_FAIL else "fail"
    s_filt: Status = "pass" if ff <= FILTERED_WARN else "warn" if ff <= FILTERED_FAIL else "fail"
    s_inv: Status = "fail" if invalid > 0 else "pass"
    status = worst(s_stale, s_filt, s_inv)
    advice = []
    if s_inv != "pass":
        advice.append("a producer sends malformed groups (see the buffer's log)")
    if s_stale != "pass":
        advice.append(
            "groups go stale before training: raise rollout.max_head_offpolicyness, lower "
            "rollout.max_concurrent_rollouts, or speed up the trainer"
        )
    if s_filt != "pass":
        advice.append(
            "most groups have equal rewards: the data is too easy or too hard for the "
            "model (inspect it; run RL on the test set)"
        )
    return Check(
        name, status, summary, "; ".join(advice) or "almost every group produced is trained", nums
    )


def starvation(ev: Evidence) -> Check:
    """Whether the run starved: the launcher's starvation verdict fails it; else the share
    of the trainer's time spent waiting for a batch, above WAIT_WARN, says generation is
    the bottleneck."""
    name = "starvation"
    wait = [float((r.get("phase_seconds") or {}).get("wait_batch", 0.0)) for r in ev.records]
    busy = [float(r.get("step_seconds", 0.0) or 0.0) for r in ev.records]
    total = sum(wait) + sum(busy)
    share = sum(wait) / total if total > 0 else 0.0
    nums: dict[str, Any] = {
        "wait_share": rounded(share, 3),
        "wait_seconds": rounded(sum(wait), 1),
        "train_seconds": rounded(sum(busy), 1),
        "verdict": ev.starvation,
    }
    summary = f"trainer waited {share:.0%} of {total:.0f}s for batches"
    if ev.starvation:
        stage, detail = ev.starvation.get("stage"), ev.starvation.get("detail")
        when = "is starving" if ev.live else "ended starving"
        return Check(
            name,
            "fail",
            f"{summary}; the run {when}: held by {stage} ({detail})",
            f"fix the stage that holds the run ({stage}); docs/operations.md lists each",
            nums,
        )
    if not ev.records:
        return Check(name, "n/a", "no step records", "", nums)
    if share > WAIT_WARN:
        return Check(
            name,
            "warn",
            summary,
            "generation is the bottleneck: add rollout replicas, raise "
            "rollout.max_concurrent_rollouts or max_head_offpolicyness",
            nums,
        )
    return Check(name, "pass", summary, "no stage held the run", nums)


def restarts(ev: Evidence) -> Check:
    """Services the launcher restarted during the run (`restarts.jsonl`)."""
    name = "restarts"
    per: dict[str, int] = {}
    for r in ev.restarts:
        per[str(r.get("service"))] = per.get(str(r.get("service")), 0) + 1
    nums = {"total": len(ev.restarts), "per_service": per}
    if not ev.restarts:
        return Check(name, "pass", "no service died", "", nums)
    by = ", ".join(f"{k} {v}" for k, v in sorted(per.items()))
    return Check(
        name,
        "warn",
        f"{len(ev.restarts)} restarts ({by})",
        "the run rode them through; see restarts.jsonl and each service's log for why",
        nums,
    )
