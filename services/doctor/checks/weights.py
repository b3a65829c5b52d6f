"""Checks of the importance weights: pi_theta / pi_prox (exactly 1 when it must be), the
behaviour weight and rejection sampling, and whether the rollout serves the trained weights."""

from __future__ import annotations

import statistics
from typing import Any

from services.doctor.evidence import Evidence, sum_by

from .base import Check, Status, rounded, worst

# importance weight pi_theta / pi_prox, mean per step
IW_EXACT_TOL = {"float32": 1e-4, "float64": 1e-6}
"""|w - 1| allowed when it must be exactly 1 (one minibatch, pi_prox recomputed): float
round-off of two forwards of the same weights. Other dtypes: `IW_EXACT_TOL_LOW`."""
IW_EXACT_TOL_LOW = 1e-2
IW_WARN, IW_FAIL = 0.05, 0.2
"""|mean w - 1| above which the importance weight warns / fails when it need not be 1."""
BW_WARN, BW_FAIL = 0.05, 0.2
"""|mean behave_imp_weight - 1| above which the behaviour weight warns / fails."""
BW_UNCAPPED_MAX = 10.0
"""A token weighted more than this with no rejection sampling set warns."""
RS_FILTERED_WARN = 0.1
"""Share of tokens masked or clamped by rejection sampling above which it warns."""


def _exact_importance_weight(ev: Evidence) -> bool | None:
    """Whether pi_theta / pi_prox must be exactly 1: one minibatch, and pi_prox (the old
    log-probabilities) recomputed by the trainer on the weights it then updates."""
    if ev.config is None:
        return None
    a = ev.config.actor
    recomputed = a.recompute_logprob and (
        not a.use_decoupled_loss or a.prox_logp_method == "recompute"
    )
    return a.ppo_n_minibatches == 1 and recomputed


def importance_weight(ev: Evidence) -> Check:
    """pi_theta / pi_prox per step: exactly 1 (within float round-off) when one
    minibatch trains on recomputed log-probabilities, else near 1 (IW_WARN / IW_FAIL)."""
    name = "importance_weight"
    w = [float(x) for x in ev.series("importance_weight")]
    if not w:
        return Check(name, "n/a", "no importance_weight in the step records", "")
    dev = max(abs(x - 1.0) for x in w)
    nums: dict[str, Any] = {
        "mean": rounded(statistics.fmean(w), 6),
        "max_abs_dev": rounded(dev, 6),
        "steps": len(w),
    }
    exact = _exact_importance_weight(ev)
    if exact:
        assert ev.config is not None
        tol = IW_EXACT_TOL.get(ev.config.actor.dtype, IW_EXACT_TOL_LOW)
        nums["tolerance"] = tol
        summary = (
            f"mean {nums['mean']}, max |w-1| {dev:.2g} over {len(w)} steps; ppo_n_minibatches "
            f"1 with pi_prox recomputed: must be 1 (tolerance {tol:g})"
        )
        if dev <= tol:
            return Check(name, "pass", summary, "pi_theta = pi_prox on the one update", nums)
        status: Status = "warn" if dev <= IW_WARN else "fail"
        return Check(
            name,
            status,
            summary,
            "the two forwards of the same weights disagree: non-deterministic kernels or "
            "weights changed between them (use deterministic algorithms; check dropout)",
            nums,
        )
    mb = ev.config.actor.ppo_n_minibatches if ev.config else "?"
    summary = f"mean {nums['mean']}, max |mean w - 1| {dev:.3g} over {len(w)} steps (ppo_n_minibatches {mb})"
    nums["ppo_n_minibatches"] = mb
    if dev <= IW_WARN:
        return Check(name, "pass", summary, "updates stay close to pi_prox", nums)
    return Check(
        name,
        "warn" if dev <= IW_FAIL else "fail",
        summary,
        "each minibatch moves the policy too far from pi_prox: reduce actor.ppo_n_minibatches "
        "or the learning rate",
        nums,
    )


def behave_imp_weight(ev: Evidence) -> Check:
    """The behaviour weight pi_prox / pi_behave: its mean near 1 (BW_WARN /
    BW_FAIL), no token weighted above BW_UNCAPPED_MAX without rejection sampling, and the
    share rejection sampling masks or clamps below RS_FILTERED_WARN."""
    name = "behave_imp_weight"
    if ev.config is not None and not ev.config.actor.use_decoupled_loss:
        return Check(
            name,
            "n/a",
            "actor.use_decoupled_loss is false: no behaviour weight (pi_prox = pi_behave)",
            "",
        )
    w = [float(x) for x in ev.series("behave_imp_weight")]
    if not w:
        return Check(name, "n/a", "no behave_imp_weight in the step records", "")
    rs = ev.config.actor.rejection_sampling if ev.config else None
    cap = (
        f"rejection_sampling {rs.level}/{rs.action}/{rs.metric} upper {rs.upper}"
        + (f" lower {rs.lower}" if rs.lower is not None else "")
        if rs is not None
        else "no rejection_sampling"
    )
    tok_max = ev.stat("behave_imp_weight/max")
    filtered = ev.stat("rs_filtered_fraction") or ev.stat("behave_filtered_ratio/avg")
    dev = max(abs(x - 1.0) for x in w)
    nums: dict[str, Any] = {
        "mean": rounded(statistics.fmean(w)),
        "max_abs_dev": rounded(dev),
        "token_max": rounded(max(tok_max)) if tok_max else None,
        "rs_filtered_fraction": rounded(statistics.fmean(filtered)) if filtered else None,
        "rejection_sampling": rs.model_dump() if rs is not None else None,
        "steps": len(w),
    }
    summary = f"mean {nums['mean']}, max |mean w - 1| {dev:.3g}"
    if nums["token_max"] is not None:
        summary += f", largest token weight {nums['token_max']}"
    if nums["rs_filtered_fraction"] is not None and rs is not None:
        summary += f", {nums['rs_filtered_fraction']:.1%} of tokens rejected"
    summary += f"; {cap}"
    status: Status = "pass" if dev <= BW_WARN else "warn" if dev <= BW_FAIL else "fail"
    if rs is None and (nums["token_max"] or 0.0) > BW_UNCAPPED_MAX:
        status = worst(status, "warn")
    if rs is not None and (nums["rs_filtered_fraction"] or 0.0) > RS_FILTERED_WARN:
        status = worst(status, "warn")
    if status == "pass":
        advice = "rollout and trainer agree on the behaviour policy"
    elif rs is None:
        advice = (
            "set actor.rejection_sampling {level: token, action: mask, metric: ratio, "
            "upper: 5.0}; if it persists, lower rollout.max_head_offpolicyness"
        )
    else:
        advice = (
            "stale or mismatched behaviour log-probs: lower rollout.max_head_offpolicyness, "
            "and check that rollout and trainer compute log-probs alike (dtype, temperature)"
        )
    return Check(name, status, summary, advice, nums)


def weight_sync(ev: Evidence) -> Check:
    """Every replica applied every weight update (step records and the rollout's
    `weight_updates_total{result}`)."""
    name = "weight_sync"
    failed_steps = [r["step"] for r in ev.records if r.get("replicas_failed")]
    pushed = [r for r in ev.records if "replicas_updated" in r]
    by_result = sum_by(ev.samples("rollout"), "flywheel_rollout_weight_updates_total", "result")
    nums = {
        "steps_with_failed_replicas": failed_steps,
        "pushes": len(pushed),
        "replica_updates_by_result": by_result,
    }
    if not pushed and not by_result:
        return Check(name, "n/a", "no weight pushes recorded", "", nums)
    refused = by_result.get("failed", 0.0)
    summary = f"{len(pushed)} pushes, {len(failed_steps)} with a replica that failed"
    if by_result:
        summary += f"; replicas applied {by_result.get('ok', 0):g}, refused {refused:g}"
    if failed_steps or refused:
        return Check(
            name,
            "fail",
            summary,
            "a replica refused or missed an update (checksum, shape, transport): it serves "
            "old weights; see the rollout's last_update_error and log",
            nums,
        )
    return Check(name, "pass", summary, "every replica applied every update", nums)


def weight_parity(ev: Evidence) -> Check:
    """The parity probe after each weight update (services/trainer/parity.py): the largest
    |log p| difference between a replica and the trainer on the same tokens. Fails while a
    replica's latest probe fails (it is paused), warns when one failed and has recovered."""
    name = "weight_parity"
    gauge = "flywheel_trainer_weight_parity_max_abs_logprob_diff"
    live = {s.labels.get("replica", ""): s.value for s in ev.samples("trainer") if s.name == gauge}
    if not ev.parity and not live:
        return Check(name, "n/a", "no parity probe results (weight_parity.jsonl)", "")
    latest: dict[str, dict[str, Any]] = {}
    for r in ev.parity:
        latest[str(r.get("replica"))] = r
    diffs = [
        float(r["max_abs_logprob_diff"])
        for r in ev.parity
        if r.get("max_abs_logprob_diff") is not None
    ]
    diffs += list(live.values())
    tol = next((float(r["tolerance"]) for r in reversed(ev.parity) if "tolerance" in r), None)
    failed = [r for r in ev.parity if not r.get("ok")]
    failing = sorted(a for a, r in latest.items() if not r.get("ok"))
    nums: dict[str, Any] = {
        "max_abs_logprob_diff": rounded(max(diffs), 8) if diffs else None,
        "tolerance": tol,
        "probes": len(ev.parity),
        "failed_probes": len(failed),
        "failed_versions": sorted({int(r.get("version", -1)) for r in failed}),
        "replicas_failing": failing,
    }
    top = f"{max(diffs):.3g}" if diffs else "none"
    summary = (
        f"max |logp diff| {top} (tolerance {tol:g}) over {len(ev.parity)} probes"
        if tol is not None
        else f"max |logp diff| {top} (live)"
    )
    if failing:
        reasons = "; ".join(f"{a}: {latest[a].get('reason')}" for a in failing)
        return Check(
            name,
            "fail",
            f"{summary}; failing now: {reasons}",
            "the replica computes with other weights than the trainer published (name "
            "mapping, shard, dtype, architecture); it is paused: compare its model and "
            "engine version with the trainer's and restart it",
            nums,
        )
    if failed:
        return Check(
            name,
            "warn",
            f"{summary}; {len(failed)} failed (versions {nums['failed_versions']}), "
            "every replica passed since",
            "a replica computed differently for a while; see weight_parity.jsonl's reasons",
            nums,
        )
    return Check(name, "pass", summary, "every replica computes what the trainer does", nums)
