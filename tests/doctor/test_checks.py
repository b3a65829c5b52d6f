"""Each doctor check, tripped on purpose by a run directory written from realistic step
records (tests/doctor/runs.py), and passing on a healthy one.

Thresholds named here are AReaL's where its guide gives one (docs/en/best_practices/
algo_perf.md in AReaL 2.0: importance weight exactly 1 with `ppo_n_minibatches == 1`,
`no_eos_ratio` above 0.05 calls for a larger `max_new_tokens`, rejection sampling
`{level: token, action: mask, metric: ratio, upper: 5.0}` against a behaviour-weight
deviation); the others are the constants of services/doctor/checks/."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.doctor import checks
from services.doctor.evidence import gather
from tests.doctor.runs import GROUPS, make_run


def by_name(run: Path) -> dict[str, checks.Check]:
    return {c.name: c for c in checks.run_checks(gather(run))}


def test_a_healthy_run_passes_every_check_with_its_numbers(tmp_path: Path):
    result = by_name(make_run(tmp_path))
    assert {n: c.status for n, c in result.items()} == {
        "importance_weight": "pass",
        "behave_imp_weight": "pass",
        "no_eos_ratio": "pass",
        "task_reward_variance": "pass",
        "staleness": "pass",
        "dropped_groups": "pass",
        # a finished run: the rollout's counters ended with it
        "reward_failures": "n/a",
        "starvation": "pass",
        "restarts": "pass",
        "weight_sync": "pass",
        "weight_parity": "pass",
        "reward_trend": "pass",
        # a text run
        "vision_images": "n/a",
        "processor_time": "n/a",
        # no agent workflow: nothing of it in the counters
        "template_drift": "n/a",
        "agent_episode_failures": "n/a",
        "tool_failures": "n/a",
    }
    assert checks.verdict(list(result.values())) == "pass"
    assert result["importance_weight"].numbers["max_abs_dev"] == 0.0
    assert result["staleness"].numbers == {"max": 1.0, "mean": 0.5, "eta": 1}
    # wait 0.2 s per 1.0 s step: 0.2 / 1.2
    assert result["starvation"].numbers["wait_share"] == pytest.approx(1 / 6, abs=1e-3)


def test_truncation_fails_and_names_max_new_tokens(tmp_path: Path):
    # The last third truncates 40% of completions, seq_len grows with it.
    run = make_run(
        tmp_path,
        per_step=lambda i: {
            "stats": {"no_eos_ratio": 0.4 if i > 20 else 0.01, "seq_len": 20.0 + i}
        },
    )
    c = by_name(run)["no_eos_ratio"]
    assert c.status == "fail"
    assert c.numbers["recent_mean"] == 0.4 and c.numbers["max_new_tokens"] == 8
    assert c.numbers["seq_len_slope_per_step"] == pytest.approx(1.0)  # 20 + i
    assert "max_new_tokens" in c.advice


def test_truncation_just_above_areal_threshold_warns(tmp_path: Path):
    # 0.06 > 0.05 (AReaL's line) but below the fail line 0.25
    run = make_run(tmp_path, per_step=lambda i: {"stats": {"no_eos_ratio": 0.06}})
    assert by_name(run)["no_eos_ratio"].status == "warn"


def test_truncation_growing_with_seq_len_warns_before_the_threshold(tmp_path: Path):
    # 0.001 i: the last third averages 0.0255 (> 0.05 / 2), rising with seq_len.
    run = make_run(
        tmp_path,
        per_step=lambda i: {"stats": {"no_eos_ratio": 0.001 * i, "seq_len": 20.0 + 2 * i}},
    )
    c = by_name(run)["no_eos_ratio"]
    assert c.status == "warn" and c.numbers["corr_with_seq_len"] == pytest.approx(1.0)


def test_behaviour_weight_blow_up_without_a_cap_fails_and_names_rejection_sampling(
    tmp_path: Path,
):
    run = make_run(
        tmp_path,
        per_step=lambda i: {
            "stats": {"behave_imp_weight/avg": 1.0 + 0.05 * i, "behave_imp_weight/max": 80.0}
        },
    )
    c = by_name(run)["behave_imp_weight"]
    assert c.status == "fail"
    assert c.numbers["max_abs_dev"] == pytest.approx(1.5)  # 1 + 0.05 * 30
    assert c.numbers["token_max"] == 80.0 and c.numbers["rejection_sampling"] is None
    assert "no rejection_sampling" in c.summary
    assert "rejection_sampling" in c.advice and "upper: 5.0" in c.advice


def test_behaviour_weight_with_rejection_sampling_rejecting_much_warns_about_staleness(
    tmp_path: Path,
):
    run = make_run(
        tmp_path,
        config={
            "actor": {"rejection_sampling": {"level": "token", "action": "mask", "upper": 5.0}}
        },
        per_step=lambda i: {"stats": {"rs_filtered_fraction": 0.3}},
    )
    c = by_name(run)["behave_imp_weight"]
    assert c.status == "warn"
    assert "upper 5.0" in c.summary and "30.0% of tokens rejected" in c.summary
    assert "max_head_offpolicyness" in c.advice


def test_behaviour_weight_is_not_judged_without_the_decoupled_loss(tmp_path: Path):
    run = make_run(tmp_path, config={"actor": {"use_decoupled_loss": False}})
    assert by_name(run)["behave_imp_weight"].status == "n/a"


@pytest.mark.parametrize(
    ("config", "weight", "status"),
    [
        # one minibatch, pi_prox recomputed, float32: |w - 1| <= 1e-4
        ({}, 1.00005, "pass"),
        ({}, 1.003, "warn"),
        ({}, 1.3, "fail"),
        # four minibatches: only the mean near 1 is asked (<= 0.05 pass, <= 0.2 warn)
        ({"actor": {"ppo_n_minibatches": 4}}, 1.03, "pass"),
        ({"actor": {"ppo_n_minibatches": 4}}, 1.1, "warn"),
        ({"actor": {"ppo_n_minibatches": 4}}, 1.3, "fail"),
    ],
)
def test_importance_weight_exact_with_one_minibatch_within_tolerance_otherwise(
    tmp_path: Path, config, weight, status
):
    run = make_run(
        tmp_path,
        config=config,
        per_step=lambda i: {"stats": {"importance_weight/avg": weight if i == 7 else 1.0}},
    )
    c = by_name(run)["importance_weight"]
    assert c.status == status, c.summary
    assert c.numbers["max_abs_dev"] == pytest.approx(abs(weight - 1), abs=1e-9)
    if config and status != "pass":
        assert "ppo_n_minibatches" in c.advice


def test_a_flat_reward_warns_and_points_at_the_playbook(tmp_path: Path):
    run = make_run(
        tmp_path,
        per_step=lambda i: {"p": 0.5},
        # 0.50 -> 0.51 over 500 prompts: z = 0.01 / sqrt(2 * 0.25 / 500) = 0.32
        evals=[
            {"step": 0, "accuracy": 0.50, "n": 500},
            {"step": 30, "accuracy": 0.51, "n": 500},
        ],
    )
    c = by_name(run)["reward_trend"]
    assert c.status == "warn"
    assert c.numbers["eval_z"] == pytest.approx(0.3164, abs=1e-3)
    assert abs(c.numbers["train_z"]) < checks.TREND_Z
    assert "test set" in c.advice


def test_a_falling_reward_fails(tmp_path: Path):
    run = make_run(tmp_path, per_step=lambda i: {"p": 0.8 - 0.02 * i})
    c = by_name(run)["reward_trend"]
    assert c.status == "fail" and c.numbers["train_z"] < -checks.TREND_Z
    assert "max_head_offpolicyness 0" in c.advice


def test_with_a_group_filter_only_the_held_out_accuracy_decides(tmp_path: Path):
    # The kept groups' task_reward rises, but a filter chooses them: not evidence.
    run = make_run(tmp_path, config={"buffer": {"filter": "dapo_equal_rewards"}})
    c = by_name(run)["reward_trend"]
    assert c.status == "n/a" and "dapo_equal_rewards" in c.summary
    run = make_run(
        tmp_path / "b",
        config={"buffer": {"filter": "dapo_equal_rewards"}},
        # 0.70 -> 0.80 over 500: z = 0.1 / sqrt(0.21/500 + 0.16/500) = 3.68
        evals=[{"step": 0, "accuracy": 0.7, "n": 500}, {"step": 30, "accuracy": 0.8, "n": 500}],
    )
    c = by_name(run)["reward_trend"]
    assert c.status == "pass" and c.numbers["eval_z"] == pytest.approx(3.676, abs=1e-3)


def test_a_reward_swinging_beyond_sampling_noise_fails(tmp_path: Path):
    # Alternating p 0.1 / 0.9: the step mean jumps ~0.8 against a bound
    # sqrt(0.25 / 32) = 0.088.
    run = make_run(tmp_path, per_step=lambda i: {"p": 0.1 if i % 2 else 0.9})
    c = by_name(run)["task_reward_variance"]
    assert c.status == "fail" and c.numbers["groups_per_step"] == GROUPS
    assert c.numbers["sampling_bound_std"] == pytest.approx(0.0884, abs=2e-3)
    assert "learning rate" in c.advice


def test_a_small_batch_warns_even_when_the_noise_is_explained(tmp_path: Path):
    # 2 groups a step: bound sqrt(0.25 / 2) = 0.35 > 0.1
    run = make_run(tmp_path, per_step=lambda i: {"p": 0.5, "group_ids": ["a", "b"]})
    c = by_name(run)["task_reward_variance"]
    assert c.status == "warn" and "consumer_batch_size" in c.advice


def test_staleness_beyond_eta_fails(tmp_path: Path):
    run = make_run(tmp_path, per_step=lambda i: {"stats": {"staleness_max": 3.0}})
    c = by_name(run)["staleness"]
    assert c.status == "fail" and c.numbers["max"] == 3.0 and c.numbers["eta"] == 1


def test_groups_dropped_as_stale_or_filtered_are_judged_from_the_ledger(tmp_path: Path):
    put = GROUPS * 30
    ledger = {
        "put_total": put,
        "acked_total": put // 4,
        "dropped_total": {"stale_at_put": put // 2, "filtered": put // 4},
        "invariant_ok": True,
    }
    run = make_run(tmp_path, summary={"steps": 30, "buffer": ledger})
    c = by_name(run)["dropped_groups"]
    # stale 1/2 (warn <= 0.5 < fail), filtered 1/4 (pass)
    assert c.status == "warn"
    assert c.numbers["stale_fraction"] == 0.5 and c.numbers["filtered_fraction"] == 0.25
    assert "max_head_offpolicyness" in c.advice


def test_a_run_that_ended_starving_on_reward_fails_starvation_and_reward(tmp_path: Path):
    verdict = {
        "stage": "reward holds",
        "detail": "8 requests in flight, no group finished in 30s",
        "numbers": {"requests_in_flight": 8},
    }
    run = make_run(tmp_path, summary={"steps": 30}, starvation=verdict)
    result = by_name(run)
    assert result["starvation"].status == "fail"
    assert "held by reward holds" in result["starvation"].summary
    assert result["reward_failures"].status == "fail"
    assert "no group finished in 30s" in result["reward_failures"].summary


def test_restarts_and_failed_weight_pushes_are_reported(tmp_path: Path):
    run = make_run(
        tmp_path,
        per_step=lambda i: {"replicas_failed": ["rollout-0"] if i == 5 else []},
        restarts=[{"service": "reward", "exit": "killed by SIGKILL"}],
    )
    result = by_name(run)
    assert result["weight_sync"].status == "fail"
    assert result["weight_sync"].numbers["steps_with_failed_replicas"] == [5]
    assert result["restarts"].status == "warn" and "reward 1" in result["restarts"].summary
    # a finished run whose reward service died: warned even without the counters
    assert result["reward_failures"].status == "warn"


def test_verdict_is_the_worst_check():
    def c(status: checks.Status) -> checks.Check:
        return checks.Check("x", status, "", "")

    assert checks.verdict([c("pass"), c("n/a")]) == "pass"
    assert checks.verdict([c("pass"), c("warn"), c("n/a")]) == "warn"
    assert checks.verdict([c("warn"), c("fail")]) == "fail"


def test_a_reward_that_never_moves_from_zero_warns_no_signal(tmp_path: Path):
    # What a truncating tiny run shows: every completion cut at max_new_tokens scores 0.
    run = make_run(tmp_path, per_step=lambda i: {"p": 0.0})
    c = by_name(run)["task_reward_variance"]
    assert c.status == "warn" and c.numbers["sampling_bound_std"] == 0.0
    assert "no group carries a learning signal" in c.advice


def test_a_starting_model_that_scores_zero_warns_even_on_a_short_run(tmp_path: Path):
    # A short demo run after too short a warm start: 0.000 held-out before and after.
    run = make_run(
        tmp_path,
        steps=6,
        per_step=lambda i: {"p": 0.1},
        evals=[{"step": 0, "accuracy": 0.0, "n": 64}, {"step": 6, "accuracy": 0.0, "n": 64}],
    )
    c = by_name(run)["reward_trend"]
    assert c.status == "warn" and c.numbers["eval_first"] == 0.0
    assert "starting model scores 0.000" in c.advice


CORRUPTED = {
    "max_abs_logprob_diff": 0.221,  # tests/trainer/test_parity.py: one sign-flipped tensor
    "ok": False,
    "reason": "max |logp diff| 0.221 > tolerance 0.001",
}


def test_a_corrupted_weight_update_fails_weight_parity_while_the_replica_is_off(tmp_path: Path):
    run = make_run(tmp_path, parity=lambda i: CORRUPTED if i >= 28 else {})
    check = by_name(run)["weight_parity"]
    assert check.status == "fail"
    assert check.numbers["max_abs_logprob_diff"] == 0.221
    assert check.numbers["failed_versions"] == [28, 29, 30]
    assert check.numbers["replicas_failing"] == ["127.0.0.1:50100"]
    assert "tolerance 0.001" in check.summary and "paused" in check.advice


def test_a_replica_that_recovered_warns_and_a_run_without_probes_is_not_judged(tmp_path: Path):
    recovered = by_name(make_run(tmp_path / "a", parity=lambda i: CORRUPTED if i == 5 else {}))
    check = recovered["weight_parity"]
    assert check.status == "warn" and check.numbers["failed_versions"] == [5]
    assert check.numbers["replicas_failing"] == []
    unprobed = by_name(make_run(tmp_path / "b", parity=None))["weight_parity"]
    assert unprobed.status == "n/a"
