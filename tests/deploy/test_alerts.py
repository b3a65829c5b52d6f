"""Alert rules: promtool checks them and runs their unit tests; every alert is tested
firing and quiet and tells the reader what to do."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"


def alerts() -> list[dict]:
    data = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [rule for group in data["groups"] for rule in group["rules"] if "alert" in rule]


def test_promtool_check_rules(promtool):
    result = subprocess.run(
        [promtool, "check", "rules", str(PROM / "alerts.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    data = yaml.safe_load((PROM / "alerts.yml").read_text())
    n_rules = sum(len(g["rules"]) for g in data["groups"])
    assert f"SUCCESS: {n_rules} rules found" in result.stdout


def test_promtool_unit_tests_pass(promtool):
    result = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"],
        capture_output=True,
        text=True,
        cwd=PROM / "tests",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_wrong_expectation_fails(promtool, tmp_path):
    """The unit tests can fail: the same file with one expectation flipped is refused."""
    tests = yaml.safe_load((PROM / "tests" / "alerts_test.yml").read_text())
    tests["rule_files"] = [str(PROM / "alerts.yml")]
    first = tests["tests"][0]["alert_rule_test"][-1]
    assert first["exp_alerts"], "the first firing case must expect alerts"
    first["exp_alerts"] = []
    (tmp_path / "t.yml").write_text(yaml.safe_dump(tests))
    result = subprocess.run(
        [promtool, "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True
    )
    assert result.returncode == 1 and "FAILED" in result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_quiet():
    tests = yaml.safe_load((PROM / "tests" / "alerts_test.yml").read_text())["tests"]
    firing, quiet = set(), set()
    for case in tests:
        for check in case["alert_rule_test"]:
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested quiet"


def test_issue_alerts_exist_with_runbooks():
    by_name = {a["alert"]: a for a in alerts()}
    assert {
        "FlywheelImportanceWeightOffOne",
        "FlywheelBehaveImpWeightOffOne",
        "FlywheelNoEosRatioHigh",
        "FlywheelRolloutVersionBehind",
        "FlywheelTrainerStarved",
        "FlywheelRewardFailureRate",
        "FlywheelNonFiniteGradientSteps",
        "FlywheelServiceDown",
        # the doctor's checks that a metric can express
        "FlywheelWeightParityOff",
        "FlywheelRewardFlat",
        "FlywheelStaleDropsHigh",
        "FlywheelGroupsFilteredHigh",
        "FlywheelWeightUpdatesRefused",
        "FlywheelServiceRestarted",
    } <= set(by_name)
    for name, rule in by_name.items():
        runbook = rule["annotations"]["runbook"]
        assert runbook.endswith(".") and len(runbook.split()) >= 12, (
            f"{name}: runbook is not a sentence"
        )
        assert rule["labels"]["severity"] in {"warning", "critical"}
    assert "0.05" in by_name["FlywheelNoEosRatioHigh"]["expr"]


def test_chart_carries_the_same_rules(dashboards_generator):
    assert (ROOT / "deploy" / "helm" / "flywheel" / "files" / "alerts.yml").read_text() == (
        PROM / "alerts.yml"
    ).read_text()
    assert dashboards_generator.stale_files() == []


def test_a_trainer_that_has_not_trained_yet_fires_nothing(promtool, tmp_path):
    """What a (re)started trainer exports before its first step, held for 40 minutes as
    Prometheus would scrape it, through every alert rule: no alert. Before, its statistic
    gauges read 0 there and both importance-weight alerts fired (|0 - 1| = 1)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from services.trainer.metrics import TrainerMetrics

    exposition = generate_latest(TrainerMetrics().registry).decode()
    labels = 'job="flywheel-trainer",instance="trainer:9400"'
    series = [{"series": f"up{{{labels}}}", "values": "1x40"}]
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            extra = "".join(f',{k}="{v}"' for k, v in sorted(sample.labels.items()))
            series.append(
                {"series": f"{sample.name}{{{labels}{extra}}}", "values": f"{sample.value}x40"}
            )
    names = {s["series"].split("{")[0] for s in series}
    assert "flywheel_trainer_steps_total" in names  # the exposition was really read
    assert "flywheel_trainer_importance_weight" not in names
    tests = {
        "rule_files": [str(PROM / "alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "35m", "alertname": a["alert"], "exp_alerts": []}
                    for a in alerts()
                    if a["alert"] != "FlywheelServiceAbsent"  # only the trainer is up here
                ],
            }
        ],
    }
    (tmp_path / "t.yml").write_text(yaml.safe_dump(tests))
    result = subprocess.run(
        [promtool, "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


DOCTOR_ALERTS = {
    "importance_weight": {"FlywheelImportanceWeightOffOne"},
    "behave_imp_weight": {"FlywheelBehaveImpWeightOffOne"},
    "no_eos_ratio": {"FlywheelNoEosRatioHigh"},
    "staleness": {"FlywheelRolloutVersionBehind"},
    "dropped_groups": {"FlywheelStaleDropsHigh", "FlywheelGroupsFilteredHigh"},
    "reward_failures": {"FlywheelRewardFailureRate"},
    "starvation": {"FlywheelTrainerStarved"},
    "restarts": {"FlywheelServiceRestarted"},
    "weight_sync": {"FlywheelWeightUpdatesRefused"},
    "weight_parity": {"FlywheelWeightParityOff"},
    "reward_trend": {"FlywheelRewardFlat"},
    "template_drift": {"FlywheelTemplateDriftHigh"},
    "agent_episode_failures": {"FlywheelAgentEpisodesFailing"},
    "tool_failures": {"FlywheelToolFailureRate"},
    "processor_time": {"FlywheelImageProcessorSlow"},
}
"""Each `flywheel doctor` check and the alerts that watch the same thing live."""
NO_ALERT = {
    # step-to-step reward noise against the binomial bound of the batch size: a judgement
    # over a whole run that needs the config, not a threshold on one series
    "task_reward_variance",
    # whether a run is a vision run is in its config, not in any series: a text run's
    # groups carry no images by design, so "no images" alone cannot say something is wrong
    "vision_images",
}


def test_every_doctor_check_a_metric_can_express_has_an_alert():
    from services.doctor import checks
    from services.doctor.evidence import Evidence

    names = {check(Evidence(ROOT, None, [])).name for check in checks.CHECKS}
    assert set(DOCTOR_ALERTS) | NO_ALERT == names
    defined = {a["alert"] for a in alerts()}
    for check, wanted in DOCTOR_ALERTS.items():
        assert wanted <= defined, f"doctor check {check}: no alert {wanted - defined}"


def test_runbooks_name_only_config_keys_the_loader_accepts():
    """The behaviour-weight runbook once told users to set actor.behave_imp_weight_cap, a
    key the loader refuses since AReaL removed it; it names actor.rejection_sampling with a
    value the loader takes."""
    import re

    from services.common.config import ConfigError, load_config

    runbook = {a["alert"]: a for a in alerts()}["FlywheelBehaveImpWeightOffOne"]["annotations"][
        "runbook"
    ]
    assert "behave_imp_weight_cap" not in runbook
    value = re.search(r"actor\.rejection_sampling \(for example (\{[^}]*\})\)", runbook)
    assert value is not None, runbook
    cfg = load_config(
        None, ["actor.use_decoupled_loss=true", f"actor.rejection_sampling={value.group(1)}"]
    )
    assert cfg.actor.rejection_sampling is not None
    assert cfg.actor.rejection_sampling.upper == 5.0
    with pytest.raises(ConfigError, match="rejection_sampling"):
        load_config(None, ["+actor.behave_imp_weight_cap=5"])
