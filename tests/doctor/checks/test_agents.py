"""The agent checks of `flywheel doctor` (`services/doctor/checks/agents.py`) on the
exposition a real rollout registry writes (`prometheus_client.generate_latest`), parsed
as the doctor parses a scrape."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from services.doctor.checks.agents import (
    agent_episode_failures,
    template_drift,
    tool_failures,
)
from services.doctor.evidence import Evidence, parse_exposition
from services.rollout.metrics import RolloutMetrics


def evidence(metrics: RolloutMetrics, tmp_path: Path) -> Evidence:
    scraped = {"rollout-0": parse_exposition(generate_latest(metrics.registry).decode())}
    return Evidence(tmp_path, None, [], live=True, scraped=scraped)


def test_without_agent_traffic_every_agent_check_is_not_applicable(tmp_path: Path) -> None:
    ev = evidence(RolloutMetrics(), tmp_path)
    assert [c(ev).status for c in (template_drift, agent_episode_failures, tool_failures)] == [
        "n/a",
        "n/a",
        "n/a",
    ]


def test_any_template_drift_warns_and_a_large_share_fails(tmp_path: Path) -> None:
    m = RolloutMetrics()
    m.openai_api.requests.labels(endpoint="chat", status="200").inc(100)
    assert template_drift(evidence(m, tmp_path)).status == "pass"
    m.openai_api.template_drift.inc(1)  # 1 of 100: any drift warns
    assert template_drift(evidence(m, tmp_path)).status == "warn"
    m.openai_api.template_drift.inc(5)  # 6 of 100 > 5 %
    check = template_drift(evidence(m, tmp_path))
    assert check.status == "fail" and check.numbers["drift_fraction"] == 0.06


def test_episode_failures_are_judged_by_share_and_named_by_reason(tmp_path: Path) -> None:
    m = RolloutMetrics()
    for _ in range(18):
        m.agent.observe_episode(turns=2, seconds=1.0)
    m.agent.observe_failure("timeout", 5.0)
    m.agent.observe_failure("timeout", 5.0)  # 2 of 20 = 10 % > 5 %
    check = agent_episode_failures(evidence(m, tmp_path))
    assert check.status == "warn" and check.numbers["failure_fraction"] == 0.1
    assert "episode_timeout" in check.advice
    for _ in range(5):
        m.agent.observe_failure("error", 1.0)  # 7 of 25 = 28 % > 25 %
    assert agent_episode_failures(evidence(m, tmp_path)).status == "fail"


def test_tool_failures_separate_sandbox_limits_from_bad_arguments(tmp_path: Path) -> None:
    m = RolloutMetrics()
    for _ in range(7):
        m.agent.observe_tool_call("calculator", "ok")
    for _ in range(3):
        m.agent.observe_tool_call("calculator", "error")  # 3 of 10 = 30 %: warn
    check = tool_failures(evidence(m, tmp_path))
    assert check.status == "warn" and "arguments" in check.advice
    for _ in range(10):
        m.agent.observe_tool_call("python", "timeout")  # 13 of 20 = 65 %: fail
    check = tool_failures(evidence(m, tmp_path))
    assert check.status == "fail" and "limits" in check.advice
