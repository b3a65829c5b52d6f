"""Dashboards as code: the committed JSON is what the generator builds, every PromQL
expression parses (promtool, through a temporary rule file), and every metric a dashboard,
an alert or an autoscaler uses is one the services' own registries export."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from .metric_names import all_exported_names, all_names_in, names_in

ROOT = Path(__file__).resolve().parents[2]
# Prometheus's own series, present on any scrape.
BUILTIN = {"up"}


@pytest.fixture(scope="module")
def boards(dashboards_generator) -> dict[str, dict]:
    return dashboards_generator.dashboards()


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return all_exported_names()


def dashboard_exprs(gen, boards) -> list[str]:
    return [e for model in boards.values() for e in gen.queries(model)]


def alert_exprs() -> list[str]:
    data = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    return [r["expr"] for g in data["groups"] for r in g["rules"]]


def test_committed_dashboards_are_current(dashboards_generator):
    assert dashboards_generator.stale_files() == [], "run python deploy/grafana/generate.py"


def test_both_dashboards_with_their_panels(boards):
    titles = {m["title"]: m for m in boards.values()}
    assert set(titles) == {"Flywheel / RL health", "Flywheel / System"}

    def panels(model):
        return {p["title"]: p for p in model["panels"] if p["type"] != "row"}

    rl = panels(titles["Flywheel / RL health"])
    for title in (
        "Importance weight",
        "Behaviour importance weight",
        "No-EOS ratio",
        "Sequence length",
        "Task reward",
        "Clip ratios",
        "Approximate KL",
        "Entropy",
        "Gradient norm",
        "Staleness histogram (trained sequences)",
        "Proximal log-prob approximation error",
    ):
        assert title in rl, title
    for title, line in (
        ("Importance weight", 1.0),
        ("Behaviour importance weight", 1.0),
        ("No-EOS ratio", 0.05),
    ):
        steps = rl[title]["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert steps[-1]["value"] == line
        assert rl[title]["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "dashed"
    system = panels(titles["Flywheel / System"])
    for title in (
        "Buffer depth",
        "Capacity for rollout",
        "Drops by reason",
        "Accounting gap",
        "Generated tokens/s per replica",
        "Served version per replica",
        "Reward latency",
        "Reward results by status",
        "Weight sync",
        "Step phases",
    ):
        assert title in system, title
    for model in boards.values():
        assert model["templating"]["list"][0]["type"] == "datasource"


def test_every_expression_parses(promtool, tmp_path, dashboards_generator, boards):
    exprs = dashboard_exprs(dashboards_generator, boards)
    assert len(exprs) >= 40
    # Grafana's interval variable is not PromQL; give it a concrete value to parse.
    rules = [
        {"record": f"flywheel:check:{i}", "expr": e.replace("$__rate_interval", "1m")}
        for i, e in enumerate(exprs)
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # ... and a broken one would not.
    path.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum(rate(foo[1m])"}]}]}
        )
    )
    assert (
        subprocess.run([promtool, "check", "rules", str(path)], capture_output=True).returncode != 0
    )


def test_name_extraction():
    expr = 'histogram_quantile(0.9, sum by (le, fn) (rate(flywheel_reward_score_seconds_bucket{status!="OK"}[5m])))'
    assert names_in(expr) == {"flywheel_reward_score_seconds_bucket"}
    assert names_in('absent(up{job="flywheel-buffer"}) or flywheel_buffer_version > 1') == {
        "up",
        "flywheel_buffer_version",
    }


def test_dashboards_use_only_exported_metrics(dashboards_generator, boards, exported):
    used = all_names_in(dashboard_exprs(dashboards_generator, boards))
    assert used - exported - BUILTIN == set()


def test_alerts_use_only_exported_metrics(exported):
    data = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    recorded = {r["record"] for g in data["groups"] for r in g["rules"] if "record" in r}
    used = all_names_in(alert_exprs())
    assert used - exported - BUILTIN - recorded == set()


def test_autoscalers_use_exported_metrics(helm_check, exported):
    values = helm_check.load_values(
        ROOT / "deploy" / "helm" / "flywheel" / "ci" / "autoscaling-values.yaml"
    )
    queries = [
        o["spec"]["triggers"][0]["metadata"]["query"]
        for o in helm_check.render(values)
        if o["kind"] == "ScaledObject"
    ]
    assert len(queries) == 2 and all_names_in(queries) <= exported
