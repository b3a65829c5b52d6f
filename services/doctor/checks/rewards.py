"""Checks of the reward signal: its noise against the batch size, rewards that could not be
computed, and whether the training reward rises."""

from __future__ import annotations

import math
import statistics
from typing import Any

from services.doctor.evidence import Evidence, sum_by

from .base import Check, Status, rounded, worst

NOISE_WARN, NOISE_FAIL = 2.0, 4.0
"""Step-to-step noise of `task_reward` over its sampling bound, above which it warns/fails."""
REWARD_SE_WARN = 0.1
"""Sampling standard error of one step's mean reward above which the batch is too small."""
REWARD_FAIL_WARN, REWARD_FAIL_FAIL = 0.01, 0.1
"""Share of completions whose reward could not be computed."""
TREND_Z = 2.0
"""Standard errors a change in reward must exceed to count as rising (or falling)."""
TREND_MIN_STEPS = 9
"""Fewer steps cannot show a trend in the training reward (thirds of 3 steps)."""
BASELINE_NEAR_ZERO = 0.02
"""A starting model at or below this held-out accuracy gives RL almost no reward to follow."""
FLAT_MIN_STEPS = 20
"""A run shorter than this that did not rise significantly is too short to call flat."""


def reward_variance(ev: Evidence) -> Check:
    """Step-to-step noise of `task_reward` against what sampling alone explains.

    A step's mean reward over G independent groups, with per-sample rewards in [a, b] and
    mean m, has variance at most (m - a)(b - m) / G (Bhatia-Davis; samples of one prompt are
    correlated, so the group is the unit). The noise is estimated from first differences,
    std(diff) / sqrt(2), which a slow trend barely moves."""
    name = "task_reward_variance"
    rew = [float(x) for x in ev.series("task_reward")]
    groups = [len(r.get("group_ids") or []) for r in ev.records if r.get("task_reward") is not None]
    if len(rew) < 5:
        return Check(name, "n/a", f"{len(rew)} steps with task_reward; need 5", "")
    g = statistics.median([x for x in groups if x] or [1])
    m = statistics.fmean(rew)
    lo, hi = min(0.0, min(rew)), max(1.0, max(rew))
    bound = math.sqrt(max((m - lo) * (hi - m), 0.0) / g)
    diffs = [b - a for a, b in zip(rew, rew[1:], strict=False)]
    noise = statistics.stdev(diffs) / math.sqrt(2) if len(diffs) > 1 else 0.0
    ratio = noise / bound if bound > 0 else 0.0
    nums = {
        "mean": rounded(m),
        "step_noise_std": rounded(noise),
        "sampling_bound_std": rounded(bound),
        "noise_over_bound": rounded(ratio, 3),
        "groups_per_step": g,
        "steps": len(rew),
    }
    summary = (
        f"step-to-step std {noise:.3f} vs {bound:.3f} from sampling {g:g} groups "
        f"(ratio {ratio:.2f}); mean {m:.3f} over {len(rew)} steps"
    )
    status: Status = "pass" if ratio <= NOISE_WARN else "warn" if ratio <= NOISE_FAIL else "fail"
    if bound == 0:
        status = "warn"
        advice = (
            f"every reward is {m:g}: no group carries a learning signal (see no_eos_ratio "
            "and reward_failures; evaluate the starting model)"
        )
    elif status != "pass":
        advice = (
            "the reward swings more than sampling explains: the policy oscillates; lower "
            "the learning rate or raise rollout.consumer_batch_size"
        )
    elif bound > REWARD_SE_WARN:
        status = "warn"
        advice = (
            f"a step's reward is known to +-{bound:.2f} only: raise "
            "rollout.consumer_batch_size (AReaL: the usual remedy for a noisy task_reward)"
        )
    else:
        advice = "the reward's noise is what the batch size explains"
    return Check(name, status, summary, advice, nums)


def reward_failures(ev: Evidence) -> Check:
    """Share of completions whose reward could not be computed
    (REWARD_FAIL_WARN / REWARD_FAIL_FAIL), by status, with the reward service's restarts."""
    name = "reward_failures"
    starving_on_reward = (ev.starvation or {}).get("stage") == "reward holds"
    reward_restarts = sum(1 for r in ev.restarts if r.get("service") == "reward")
    ro = ev.samples("rollout")
    failures = sum_by(ro, "flywheel_rollout_reward_failures_total", "status")
    completions = sum(sum_by(ro, "flywheel_rollout_completions_total").values())
    results = sum_by(ev.samples("reward"), "flywheel_reward_results_total", "status")
    nums: dict[str, Any] = {
        "failures_by_status": failures,
        "completions": completions,
        "reward_results_by_status": results,
        "reward_restarts": reward_restarts,
        "starving_on_reward": starving_on_reward,
    }
    if not ro and not results:
        if starving_on_reward or reward_restarts:
            detail = (ev.starvation or {}).get("detail", "")
            return Check(
                name,
                "fail" if starving_on_reward else "warn",
                f"reward restarts {reward_restarts}"
                + (f"; the trainer starved on reward: {detail}" if starving_on_reward else ""),
                "the reward service stalls or dies: see logs/reward.log (worker timeouts, "
                "memory) and raise reward.num_workers or its timeout",
                nums,
            )
        return Check(
            name,
            "n/a",
            "the rollout's reward counters end with its processes: run doctor while the run "
            "is live to see them",
            "",
            nums,
        )
    failed = sum(failures.values())
    frac = failed / completions if completions else (1.0 if failed else 0.0)
    nums["failure_fraction"] = rounded(frac)
    by = ", ".join(f"{k} {v:g}" for k, v in sorted(failures.items())) or "none"
    summary = f"{failed:g} of {completions:g} completions without a reward ({frac:.1%}: {by})"
    ok_results = results.get("OK", 0.0)
    bad_results = sum(v for k, v in results.items() if k != "OK")
    if results:
        summary += f"; reward service: {ok_results:g} OK, {bad_results:g} not"
    if reward_restarts:
        summary += f"; reward restarts {reward_restarts}"
    status: Status = (
        "pass" if frac <= REWARD_FAIL_WARN else "warn" if frac <= REWARD_FAIL_FAIL else "fail"
    )
    if starving_on_reward:
        status = "fail"
        summary += f"; the trainer starves on reward: {(ev.starvation or {}).get('detail', '')}"
    elif reward_restarts:
        status = worst(status, "warn")
    if status == "pass":
        advice = "rewards are computed"
    elif failures.get("TIMEOUT", 0) >= failed / 2 and failed:
        advice = (
            "rewards time out: raise the reward timeout or reward.num_workers, or make the "
            "reward function faster (see logs/reward.log)"
        )
    else:
        advice = "the reward function fails or stalls: see logs/reward.log"
    return Check(name, status, summary, advice, nums)


def reward_trend(ev: Evidence) -> Check:
    """Rising if the held-out accuracy (first vs last evaluation, binomial errors) or the
    training reward (first vs last third of the steps) rose by more than `TREND_Z` standard
    errors; falling likewise; flat otherwise. With a group filter at the buffer the training
    reward is that of the groups kept, so only the held-out accuracy counts."""
    name = "reward_trend"
    rew = [float(x) for x in ev.series("task_reward")]
    filt = ev.config.buffer.filter if ev.config else None
    nums: dict[str, Any] = {"steps": len(rew), "buffer_filter": filt}
    zs: list[float] = []
    parts: list[str] = []
    if len(rew) >= TREND_MIN_STEPS and not filt:
        k = len(rew) // 3
        a, b = rew[:k], rew[-k:]
        se = math.sqrt(statistics.variance(a) / k + statistics.variance(b) / k) or 1e-9
        z = (statistics.fmean(b) - statistics.fmean(a)) / se
        nums.update(
            train_first=rounded(statistics.fmean(a)), train_last=rounded(statistics.fmean(b))
        )
        nums["train_z"] = rounded(z, 3)
        zs.append(z)
        parts.append(f"task_reward {nums['train_first']} -> {nums['train_last']} (z {z:+.1f})")
    evals = [e for e in ev.evals if e.get("accuracy") is not None]
    if len(evals) >= 2:
        e0, e1 = evals[0], evals[-1]
        p0, p1 = float(e0["accuracy"]), float(e1["accuracy"])
        n0, n1 = int(e0.get("n", 0) or 0), int(e1.get("n", 0) or 0)
        if n0 and n1:
            se = math.sqrt(p0 * (1 - p0) / n0 + p1 * (1 - p1) / n1) or 1e-9
            z = (p1 - p0) / se
            nums.update(eval_first=p0, eval_last=p1, eval_n=n1, eval_z=rounded(z, 3))
            zs.append(z)
            parts.append(f"held-out accuracy {p0:.3f} -> {p1:.3f} over {n1} (z {z:+.1f})")
    if not zs:
        why = (
            f"buffer.filter {filt}: task_reward is the kept groups' and no evaluation pair"
            if filt
            else f"{len(rew)} steps and no evaluation before and after"
        )
        return Check(name, "n/a", f"{why}: too little to tell a trend", "", nums)
    summary = "; ".join(parts)
    if max(zs) > TREND_Z:
        return Check(name, "pass", summary, "the policy learns", nums)
    if nums.get("eval_first") is not None and nums["eval_first"] <= BASELINE_NEAR_ZERO:
        return Check(
            name,
            "warn" if min(zs) >= -TREND_Z else "fail",
            summary,
            f"the starting model scores {nums['eval_first']:.3f} held-out: RL has nothing to "
            "sharpen; fine-tune it first (a longer warm start, SFT) or start from a stronger one",
            nums,
        )
    if min(zs) < -TREND_Z:
        return Check(
            name,
            "fail",
            summary,
            "reward falls: switch to synchronous RL (rollout.max_head_offpolicyness 0) to "
            "rule out off-policyness, then lower the learning rate",
            nums,
        )
    if len(ev.records) < FLAT_MIN_STEPS:
        return Check(
            name,
            "n/a",
            f"{summary}: {len(ev.records)} steps, too short to call it flat",
            "",
            nums,
        )
    return Check(
        name,
        "warn",
        summary,
        "reward is flat: evaluate the starting model, then run RL on the test set; rising "
        "there but not here points at the data, flat there at hyper-parameters or the model",
        nums,
    )
