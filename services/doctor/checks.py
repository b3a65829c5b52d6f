"""The checks of `flywheel doctor`: pure functions from a run's evidence to a verdict.

Each check returns pass / warn / fail (or n/a when its input is missing), the numbers it
judged and one line of advice. The thresholds follow AReaL's diagnosis guide where it gives
one (`no_eos_ratio` above 0.05; importance weight exactly 1 with one minibatch; both weights'
means close to 1) and are stated here where it does not; docs/troubleshooting.md explains
each.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from services.doctor.evidence import Evidence, sum_by

Status = Literal["pass", "warn", "fail", "n/a"]
SEVERITY: dict[str, int] = {"n/a": 0, "pass": 0, "warn": 1, "fail": 2}

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
NO_EOS_WARN, NO_EOS_FAIL = 0.05, 0.25
"""Recent `no_eos_ratio` above which truncation warns (AReaL's 0.05) / fails."""
NOISE_WARN, NOISE_FAIL = 2.0, 4.0
"""Step-to-step noise of `task_reward` over its sampling bound, above which it warns/fails."""
REWARD_SE_WARN = 0.1
"""Sampling standard error of one step's mean reward above which the batch is too small."""
STALE_WARN, STALE_FAIL = 0.1, 0.5
FILTERED_WARN, FILTERED_FAIL = 0.8, 0.95
"""Shares of the groups put that were dropped as stale / filtered out (a filter keeping one
group in five makes the rollout generate five times what is trained)."""
BUFFER_DECISIONS = frozenset({"filtered", "stale", "stale_at_put", "stale_at_claim", "duplicate"})
"""Reasons of `flywheel_rollout_groups_rejected_total` that repeat the buffer's own count."""
REWARD_FAIL_WARN, REWARD_FAIL_FAIL = 0.01, 0.1
"""Share of completions whose reward could not be computed."""
WAIT_WARN = 0.9
"""Share of the trainer's time spent waiting for a batch above which it warns."""
TREND_Z = 2.0
"""Standard errors a change in reward must exceed to count as rising (or falling)."""
TREND_MIN_STEPS = 9
"""Fewer steps cannot show a trend in the training reward (thirds of 3 steps)."""
BASELINE_NEAR_ZERO = 0.02
"""A starting model at or below this held-out accuracy gives RL almost no reward to follow."""
FLAT_MIN_STEPS = 20
"""A run shorter than this that did not rise significantly is too short to call flat."""


@dataclass
class Check:
    name: str
    status: Status
    summary: str
    """The numbers, in one line."""
    advice: str
    """What to do about it, in one line."""
    numbers: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def _worst(*statuses: Status) -> Status:
    return max(statuses, key=lambda s: SEVERITY[s] + (0.5 if s == "pass" else 0))


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
    name = "importance_weight"
    w = [float(x) for x in ev.series("importance_weight")]
    if not w:
        return Check(name, "n/a", "no importance_weight in the step records", "")
    dev = max(abs(x - 1.0) for x in w)
    nums: dict[str, Any] = {
        "mean": _r(statistics.fmean(w), 6),
        "max_abs_dev": _r(dev, 6),
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
        "mean": _r(statistics.fmean(w)),
        "max_abs_dev": _r(dev),
        "token_max": _r(max(tok_max)) if tok_max else None,
        "rs_filtered_fraction": _r(statistics.fmean(filtered)) if filtered else None,
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
        status = _worst(status, "warn")
    if rs is not None and (nums["rs_filtered_fraction"] or 0.0) > RS_FILTERED_WARN:
        status = _worst(status, "warn")
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


def _slope(ys: Sequence[float]) -> float:
    n = len(ys)
    if n < 2:
        return 0.0
    xm = (n - 1) / 2
    ym = statistics.fmean(ys)
    den = sum((i - xm) ** 2 for i in range(n))
    return sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / den


def _corr(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if len(xs) < 3 or len(xs) != len(ys):
        return None
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:  # a constant series
        return None


def no_eos_ratio(ev: Evidence) -> Check:
    name = "no_eos_ratio"
    r = [float(x) for x in ev.series("no_eos_ratio")]
    if not r:
        return Check(name, "n/a", "no no_eos_ratio in the step records", "")
    recent = r[-max(1, len(r) // 3) :]
    seq = ev.stat("seq_len") or ev.stat("response_len")
    max_new = ev.config.gconfig.max_new_tokens if ev.config else None
    nums: dict[str, Any] = {
        "mean": _r(statistics.fmean(r)),
        "recent_mean": _r(statistics.fmean(recent)),
        "max": _r(max(r)),
        "max_new_tokens": max_new,
    }
    if len(seq) == len(r):
        nums["seq_len_first"], nums["seq_len_last"] = _r(seq[0], 1), _r(seq[-1], 1)
        nums["seq_len_slope_per_step"] = _r(_slope(seq))
        nums["corr_with_seq_len"] = _r(_corr(seq, r), 3)
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
        "mean": _r(m),
        "step_noise_std": _r(noise),
        "sampling_bound_std": _r(bound),
        "noise_over_bound": _r(ratio, 3),
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


def staleness(ev: Evidence) -> Check:
    name = "staleness"
    worst = [float(x) for x in ev.series("staleness_max")]
    if not worst:
        return Check(name, "n/a", "no staleness in the step records", "")
    eta: int | None = (
        ev.config.rollout.max_head_offpolicyness if ev.config else (ev.summary or {}).get("eta")
    )
    mean = statistics.fmean(float(x) for x in ev.series("staleness_avg") or [0.0])
    nums = {"max": max(worst), "mean": _r(mean, 3), "eta": eta}
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
        "stale_fraction": _r(stale / total),
        "filtered_fraction": _r(filtered / total),
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
    status = _worst(s_stale, s_filt, s_inv)
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


def reward_failures(ev: Evidence) -> Check:
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
    nums["failure_fraction"] = _r(frac)
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
        status = _worst(status, "warn")
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


def starvation(ev: Evidence) -> Check:
    name = "starvation"
    wait = [float((r.get("phase_seconds") or {}).get("wait_batch", 0.0)) for r in ev.records]
    busy = [float(r.get("step_seconds", 0.0) or 0.0) for r in ev.records]
    total = sum(wait) + sum(busy)
    share = sum(wait) / total if total > 0 else 0.0
    nums: dict[str, Any] = {
        "wait_share": _r(share, 3),
        "wait_seconds": _r(sum(wait), 1),
        "train_seconds": _r(sum(busy), 1),
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


def weight_sync(ev: Evidence) -> Check:
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
        "max_abs_logprob_diff": _r(max(diffs), 8) if diffs else None,
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
        nums.update(train_first=_r(statistics.fmean(a)), train_last=_r(statistics.fmean(b)))
        nums["train_z"] = _r(z, 3)
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
            nums.update(eval_first=p0, eval_last=p1, eval_n=n1, eval_z=_r(z, 3))
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


CHECKS: tuple[Callable[[Evidence], Check], ...] = (
    importance_weight,
    behave_imp_weight,
    no_eos_ratio,
    reward_variance,
    staleness,
    dropped_groups,
    reward_failures,
    starvation,
    restarts,
    weight_sync,
    weight_parity,
    reward_trend,
)


def run_checks(ev: Evidence) -> list[Check]:
    return [check(ev) for check in CHECKS]


def verdict(checks: Sequence[Check]) -> Status:
    """fail if any check fails, else warn if any warns, else pass."""
    worst = max((SEVERITY[c.status] for c in checks), default=0)
    return "fail" if worst == 2 else "warn" if worst == 1 else "pass"
