"""`docs/metrics.md` against the code (`tools/gen_metrics_docs.py`).

The generated tables must be current (what CI runs), the check must catch a metric added
without regenerating, and two checks that do not go through the generator: every series the
services' registries export (read the way the deploy tests read them) and every statistic
name of the algorithm core is on the page, and every series a Grafana dashboard or an alert
rule of `deploy/` queries is one the page documents.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter

from services.trainer.algorithms.stats import (
    PROX_APPROX_METHODS,
    PROX_ERROR_KINDS,
    PROX_ERROR_QUANTITIES,
    STATS,
)
from tests.deploy.metric_names import SERVICES, all_names_in, exported_names

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
sys.path.insert(0, str(ROOT / "tools"))

import gen_metrics_docs  # noqa: E402

# Prometheus's own series, present on any scrape.
BUILTIN = {"up"}


def _documented() -> set[str]:
    """Every name the page writes in backticks (label selectors cut off)."""
    text = DOC.read_text(encoding="utf-8")
    return {re.split(r"[{\[]", m)[0] for m in re.findall(r"`([^`\n]+)`", text)}


def _is_documented(series: str, documented: set[str]) -> bool:
    """A sample series is documented by its family's row: a histogram's `_bucket`, `_sum`,
    `_count` by the histogram, a counter's `_created` by its `_total`."""
    if series in documented:
        return True
    for suffix in ("_bucket", "_sum", "_count", "_created"):
        if series.endswith(suffix):
            family = series.removesuffix(suffix)
            return family in documented or family + "_total" in documented
    return False


def test_committed_page_matches_the_code() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_metrics_docs.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("service", SERVICES)
def test_every_exported_series_is_documented(service: str) -> None:
    documented = _documented()
    missing = sorted(n for n in exported_names(service) if not _is_documented(n, documented))
    assert missing == [], f"not in docs/metrics.md: {missing}"


def test_every_statistic_is_documented() -> None:
    documented = _documented()
    folded = "prox_approx/<method>/<quantity>_<error>"
    missing = [n for n in STATS if n not in documented and not n.startswith("prox_approx/")]
    assert missing == [], missing
    # The folded row stands for exactly the names STATS has under prox_approx/.
    assert folded in documented
    expanded = {
        f"prox_approx/{m}/{q}_{k}"
        for m in PROX_APPROX_METHODS
        for q in PROX_ERROR_QUANTITIES
        for k in PROX_ERROR_KINDS
    }
    assert expanded == {n for n in STATS if n.startswith("prox_approx/")}
    # AReaL's names a user looks for first, with their reductions.
    for name in ("importance_weight/avg", "behave_imp_weight/max", "no_eos_ratio", "task_reward"):
        assert name in documented, name
    assert "ppo_actor/update/importance_weight/min" in documented
    assert "ppo_actor/no_eos_ratios/avg" in documented


def test_rows_carry_type_labels_help_and_what_to_look_at() -> None:
    text = DOC.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `flywheel_buffer_dropped"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["`flywheel_buffer_dropped_groups_total`", "counter", "`reason`"]
    assert cells[3] == "Groups dropped without training, by reason."  # the served help text
    assert "max_head_offpolicyness" in cells[4]  # from services/buffer/metrics.py's table
    # A row whose module table names two series: the short second name is expanded.
    row = next(line for line in text.splitlines() if line.startswith("| `flywheel_buffer_stored_b"))
    assert "backpressure soon" in row
    row = next(line for line in text.splitlines() if line.startswith("| `flywheel_buffer_accepted"))
    assert "accepted far below admitted" in row  # `_accepted_groups` replaces three segments
    # The shared outage series appear under each service that calls peers.
    for service in ("rollout", "trainer"):
        assert f"`flywheel_{service}_peer_unavailable_seconds_total`" in text


def test_check_catches_a_metric_added_without_regenerating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What other developers do every day: a new series in a metrics class."""
    import services.reward.metrics as reward_metrics

    original = reward_metrics.RewardMetrics.__init__

    def with_one_more(self: Any, registry: Any = None) -> None:
        original(self, registry)
        self.probe = Counter(
            "flywheel_reward_probe_things",
            "Things a probe counted.",
            ["kind"],
            registry=self.registry,
        )

    monkeypatch.setattr(reward_metrics.RewardMetrics, "__init__", with_one_more)
    committed = DOC.read_text(encoding="utf-8")
    assert gen_metrics_docs.stale_regions(committed) == ["reward"]
    table = gen_metrics_docs.service_table("reward")
    assert (
        "| `flywheel_reward_probe_things_total` | counter | `kind` | Things a probe counted. | — |"
        in (table)
    )


def test_check_fails_on_a_stale_file_and_write_mends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = tmp_path / "metrics.md"
    committed = DOC.read_text(encoding="utf-8")
    stale.write_text(
        committed.replace("| `flywheel_buffer_redis_up` |", "| `flywheel_buffer_up` |")
    )
    monkeypatch.setattr(gen_metrics_docs, "OUT", stale)
    assert gen_metrics_docs.main(["--check"]) == 1
    assert gen_metrics_docs.main([]) == 0 and gen_metrics_docs.main(["--check"]) == 0
    assert stale.read_text(encoding="utf-8") == committed  # the prose is left as it was
    # A page without a region gets it appended, heading included.
    stale.write_text("# Metrics\n")
    assert gen_metrics_docs.main([]) == 0 and gen_metrics_docs.main(["--check"]) == 0
    assert "## `trainer` (`flywheel_trainer_*`)" in stale.read_text(encoding="utf-8")


def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from _exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(item)


def test_dashboards_and_alerts_query_only_documented_series() -> None:
    boards = sorted((ROOT / "deploy").glob("**/dashboards/*.json"))
    alerts = [ROOT / "deploy" / "prometheus" / "alerts.yml"]
    assert boards and alerts[0].is_file()
    exprs = [e for b in boards for e in _exprs(json.loads(b.read_text(encoding="utf-8")))]
    recorded: set[str] = set()
    for path in alerts:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        exprs += [r["expr"] for g in data["groups"] for r in g["rules"]]
        recorded |= {r["record"] for g in data["groups"] for r in g["rules"] if "record" in r}
    assert len(exprs) >= 40
    documented = _documented()
    used = all_names_in(e.replace("$__rate_interval", "1m") for e in exprs)
    unknown = sorted(n for n in used - BUILTIN - recorded if not _is_documented(n, documented))
    assert unknown == [], f"deploy/ queries series docs/metrics.md does not document: {unknown}"


def test_each_series_is_listed_once_even_when_a_part_is_its_own_class() -> None:
    # RolloutMetrics holds AgentMetrics and OpenAIApiMetrics, each also a *Metrics class.
    for service in gen_metrics_docs.services_with_metrics():
        series = [f.series for f in gen_metrics_docs.families(service)]
        assert len(series) == len(set(series)), service
    rollout = {f.series for f in gen_metrics_docs.families("rollout")}
    assert "flywheel_rollout_agent_tool_calls_total" in rollout
