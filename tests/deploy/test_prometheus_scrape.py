"""A real Prometheus (Debian's package) scrapes all four services of a short real training
run, loads the alert rules, and answers both dashboards' queries with data.

Why: the dashboard and alert tests elsewhere check names against the services' registries
and the syntax with promtool, but only a real server scraping a real run shows that the
panels an operator opens first are not empty — that the rollout and the trainer (the
services with the training signals) actually serve their metrics on the ports the
launcher publishes, under the job names the "Services up" panel and the alerts expect,
with values that make sense for the run (one minibatch per step: importance weight 1;
the accounting gap 0; weights served by the rollout at least version 1).

The run is `flywheel run` as a user starts it, with more steps than the test waits for;
the test stops it with SIGTERM, as a scheduler would, and fails if any process of the run
outlives the launcher.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .local_run import LocalRun, wait_for
from .metric_names import exported_names

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("buffer", "reward", "rollout", "trainer")
pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


def metrics_urls(addresses: dict[str, Any]) -> dict[str, list[str]]:
    """Service -> its /metrics URLs (one per rollout replica), from services.json."""
    return {
        name: [ep["metrics"] for ep in addresses[name]]
        if isinstance(addresses[name], list)
        else [addresses[name]["metrics"]]
        for name in SERVICES
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[LocalRun]:
    local = LocalRun(tmp_path_factory.mktemp("flywheel-run")).start()
    failed = True
    try:
        local.addresses()
        yield local
        failed = False
    finally:
        leftovers = local.stop()
        if not failed:
            assert not leftovers, f"processes of the run outlived the launcher: {leftovers}"


@pytest.fixture(scope="module")
def prometheus(prometheus_binary, run, tmp_path_factory) -> Iterator[str]:
    """A Prometheus scraping every service of the run each second, under the job names
    the dashboards and alerts select (`flywheel-<service>`)."""
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    rules = tmp / "alerts.yml"
    rules.write_text((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    urls = metrics_urls(run.addresses())
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                "job_name": f"flywheel-{name}",
                "static_configs": [
                    {"targets": [urllib.parse.urlsplit(u).netloc for u in urls[name]]}
                ],
            }
            for name in SERVICES
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            prometheus_binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"

    def alive() -> None:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {proc.returncode}: {proc.stderr.read()}")

    try:
        wait_for(lambda: get(f"{base}/-/ready")[0] == 200, "prometheus ready", 60.0, alive)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(base: str, expr: str) -> list[dict[str, Any]]:
    """The instant-vector result of `expr`; any error of the server fails the test."""
    status, body = get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    payload = json.loads(body or b"{}")
    assert status == 200 and payload.get("status") == "success", f"{expr}: {status} {payload}"
    return payload["data"]["result"]


def scalar(base: str, expr: str) -> float | None:
    result = query(base, expr)
    return float(result[0]["value"][1]) if result else None


def grafana_expr(expr: str) -> str:
    """What Grafana sends for a dashboard expression (its interval variable filled in)."""
    return expr.replace("$__rate_interval", "1m")


def panels(model: dict[str, Any]) -> dict[str, list[str]]:
    """Panel title -> its PromQL expressions, rows and nested panels included."""
    out: dict[str, list[str]] = {}
    stack = list(model.get("panels") or [])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels") or [])
        exprs = [t["expr"] for t in panel.get("targets") or [] if t.get("expr")]
        if exprs:
            out[panel["title"]] = exprs
    return out


# Every query of every panel must return data during the run, except queries of series that
# only exist after events a healthy short run need not have (a labelled counter has no
# series until its first increment). A new panel is covered without touching this test.
QUIET_SERIES = {
    # one label per approximation, set only with actor.prox_logp_method=metrics
    "flywheel_trainer_stat": "prox-approximation errors",
    # labelled by reason: no group is rejected by the rollout in a healthy run
    "flywheel_rollout_groups_rejected_total": "rollout rejections",
    # labelled by reason: no reward worker is killed or crashes in a healthy run
    "flywheel_reward_worker_restarts_total": "reward worker restarts",
    # labelled by tool and outcome, and by reason: a text run calls no tool, runs no agent
    "flywheel_rollout_agent_tool_calls_total": "agent tool calls",
    "flywheel_rollout_agent_episode_failures_total": "agent episode failures",
}
DASHBOARD_UIDS = {"flywheel-rl-health", "flywheel-system"}


def test_prometheus_scrapes_all_four_services_and_answers_both_dashboards(
    prometheus, run, dashboards_generator
):
    # every target of the four jobs answers its scrapes
    def all_up() -> dict[str, float] | None:
        up = {r["metric"]["job"]: float(r["value"][1]) for r in query(prometheus, "up")}
        return up if up == {f"flywheel-{n}": 1.0 for n in SERVICES} else None

    wait_for(all_up, "up == 1 for all four jobs", 90.0, run.alive)

    # the trainer has stepped and the rollout serves weights it published, as scraped
    wait_for(
        lambda: (scalar(prometheus, "min(flywheel_rollout_weight_version)") or 0) >= 1,
        "a rollout replica serving trained weights (version >= 1)",
        90.0,
        run.alive,
    )

    models = {m["uid"]: m for m in dashboards_generator.dashboards().values()}
    assert set(models) == DASHBOARD_UIDS

    # every expression of both dashboards evaluates without error on the real server
    for model in models.values():
        for exprs in panels(model).values():
            for expr in exprs:
                query(prometheus, grafana_expr(expr))

    # and shows data; rate() needs two scrapes in its window and histogram_quantile() an
    # observation in it, so this waits for a few more seconds of the run
    every_query = [
        (f"{uid}/{title}", expr)
        for uid, model in models.items()
        for title, exprs in panels(model).items()
        for expr in exprs
    ]
    must_show = [(w, e) for w, e in every_query if not any(q in e for q in QUIET_SERIES)]
    for series in QUIET_SERIES:  # an exemption no query needs any more is removed
        assert any(series in e for _, e in every_query), f"{series} is in no dashboard query"
    assert len(must_show) == len(every_query) - len(QUIET_SERIES)  # one query per exemption

    def empty_panels() -> list[str]:
        return [
            f"{where}: {expr}"
            for where, expr in must_show
            if not query(prometheus, grafana_expr(expr))
        ]

    missing: list[str] = []

    def all_panels_show() -> bool:
        missing[:] = empty_panels()
        return not missing

    try:
        wait_for(all_panels_show, "dashboard panels with data", 60.0, run.alive)
    except AssertionError as err:
        raise AssertionError(f"{err}; panels without data: {missing}") from None

    system = panels(models["flywheel-system"])
    health = panels(models["flywheel-rl-health"])
    # "Services up": 1 + 1 + 1 + 1 targets
    assert scalar(prometheus, system["Services up"][0]) == 4.0
    # One minibatch per step (ppo_n_minibatches=1): the only update is taken at
    # pi_theta = pi_prox, so the mean ratio pi_theta/pi_prox is exp(0) = 1.
    importance = scalar(prometheus, health["Importance weight"][0])
    assert importance is not None and abs(importance - 1.0) < 1e-4, importance
    # the trainer has published at least one version and the buffer holds it
    assert (scalar(prometheus, system["Policy version"][0]) or 0) >= 1
    assert (scalar(prometheus, "max(flywheel_trainer_steps_total)") or 0) >= 1
    # put = acked + dropped + pending + in flight, from one consistent snapshot: gap 0
    assert scalar(prometheus, system["Accounting gap"][0]) == 0.0
    assert scalar(prometheus, system["Accounting invariant"][0]) == 1.0
    # the rollout has generated tokens (the throughput panel's rate is positive)
    tokens = query(prometheus, grafana_expr(system["Generated tokens/s per replica"][0]))
    assert all(float(r["value"][1]) > 0 for r in tokens), tokens

    # the alert rules loaded; with all four services healthy none of these fires
    _, body = get(f"{prometheus}/api/v1/rules")
    groups = json.loads(body)["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    declared = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    n_declared = sum(len(g["rules"]) for g in declared["groups"])
    assert len(rules) == n_declared and all(r["health"] == "ok" for r in rules.values()), rules
    for name in (
        "FlywheelServiceDown",
        "FlywheelServiceAbsent",
        "FlywheelBufferInvariantBroken",
        "FlywheelRedisUnreachable",
        "FlywheelNonFiniteGradientSteps",
        "FlywheelWeightParityOff",
        "FlywheelWeightUpdatesRefused",
        "FlywheelServiceRestarted",
    ):
        assert rules[name]["state"] == "inactive", (name, rules[name])


def test_served_series_are_the_declared_ones(run):
    """What each running service serves is what its registry declares, so the name checks
    of the dashboard and alert tests (made against the registries) hold for the real run."""
    from prometheus_client.parser import text_string_to_metric_families

    for name, urls in metrics_urls(run.addresses()).items():
        for url in urls:
            status, body = wait_for(
                lambda u=url: (r := get(u))[0] == 200 and r, f"{url} serving", 90.0, run.alive
            )
            served = {
                s.name for f in text_string_to_metric_families(body.decode()) for s in f.samples
            }
            ours = {n for n in served if n.startswith(f"flywheel_{name}_")}
            assert ours, f"{name} serves no flywheel_{name}_* series"
            assert ours <= exported_names(name), ours - exported_names(name)
    # the buffer's Redis accounting (the collector the registry test has to feed) is live
    _, body = get(metrics_urls(run.addresses())["buffer"][0])
    for series in (
        "flywheel_buffer_version",
        "flywheel_buffer_capacity_groups",
        "flywheel_buffer_invariant_ok",
    ):
        assert f"\n{series} " in body.decode(), series
