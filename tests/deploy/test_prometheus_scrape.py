"""A real Prometheus (Debian's package) scrapes real services of a short local run, loads
the alert rules, and answers the dashboards' queries with data.

The buffer (on a real redis-server) and the reward service are started as a user would,
`python -m services.<name> --config FILE overrides`; every dashboard expression is then
evaluated by that Prometheus (none may error) and the "Policy version" and "Services up"
panels' queries must return series. The series names the running services serve are
compared with what their registries declare (the basis of the name checks elsewhere).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from .metric_names import exported_names

ROOT = Path(__file__).resolve().parents[2]
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


def wait_for(predicate, what: str, timeout: float = 90.0, procs: list[subprocess.Popen] = ()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(
                    f"{what}: process exited with {p.returncode}: {p.stderr.read()[-2000:] if p.stderr else ''}"
                )
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def services(redis_server, tmp_path) -> Iterator[dict[str, int]]:
    ports = {name: (free_port(), free_port()) for name in ("buffer", "reward")}
    overrides = [
        f"buffer.redis_url={redis_server.url}",
        "reward.num_workers=1",
        *[f"services.{n}.port={g}" for n, (g, _) in ports.items()],
        *[f"services.{n}.metrics_port={m}" for n, (_, m) in ports.items()],
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FLYWHEEL_TOKEN", None)
    procs = {}
    try:
        for name in ports:
            procs[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    f"services.{name}",
                    "--config",
                    str(ROOT / "examples" / "grpo.yaml"),
                    *overrides,
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        for name, (_, metrics) in ports.items():
            wait_for(
                lambda m=metrics: get(f"http://127.0.0.1:{m}/readyz")[0] == 200,
                f"{name} ready",
                procs=[procs[name]],
            )
        yield {name: metrics for name, (_, metrics) in ports.items()}
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def prometheus(prometheus_binary, services, tmp_path) -> Iterator[str]:
    port = free_port()
    rules = tmp_path / "alerts.yml"
    rules.write_text((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": f"flywheel-{name}", "static_configs": [{"targets": [f"127.0.0.1:{m}"]}]}
            for name, m in services.items()
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            prometheus_binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: get(f"{base}/-/ready")[0] == 200, "prometheus ready", procs=[proc])
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def query(base: str, expr: str) -> dict:
    status, body = get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    payload = json.loads(body or b"{}")
    assert status == 200 and payload.get("status") == "success", f"{expr}: {status} {payload}"
    return payload["data"]


def test_prometheus_scrapes_services_and_answers_dashboard_queries(
    prometheus, services, dashboards_generator
):
    # both targets up (the "Services up" stat counts them)
    def both_up():
        result = query(prometheus, 'sum(up{job=~"flywheel-(buffer|reward|rollout|trainer)"})')[
            "result"
        ]
        return result and float(result[0]["value"][1]) == 2.0

    wait_for(both_up, "both targets scraped")
    # the "Policy version" panel: the buffer's version series, with data
    version = wait_for(
        lambda: query(prometheus, "max(flywheel_buffer_version)")["result"], "buffer version series"
    )
    assert float(version[0]["value"][1]) == 0.0  # nothing trained yet
    invariant = query(prometheus, "min(flywheel_buffer_invariant_ok)")["result"]
    assert float(invariant[0]["value"][1]) == 1.0
    # every dashboard expression evaluates without error on the real server
    exprs = [
        e
        for m in dashboards_generator.dashboards().values()
        for e in dashboards_generator.queries(m)
    ]
    for expr in exprs:
        query(prometheus, expr.replace("$__rate_interval", "1m"))
    # the alert rules loaded, and none fires for the two healthy services
    status, body = get(f"{prometheus}/api/v1/rules")
    groups = json.loads(body)["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert len(rules) == 11 and all(r["health"] == "ok" for r in rules.values())
    assert rules["FlywheelServiceDown"]["state"] == "inactive"


def test_served_series_are_the_declared_ones(services):
    for name, port in services.items():
        status, body = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        from prometheus_client.parser import text_string_to_metric_families

        served = {s.name for f in text_string_to_metric_families(body.decode()) for s in f.samples}
        ours = {n for n in served if n.startswith(f"flywheel_{name}_")}
        assert ours, f"{name} serves no flywheel_{name}_* series"
        assert ours <= exported_names(name), ours - exported_names(name)
    # the buffer's Redis accounting (the collector the registry test has to feed) is live
    _, body = get(f"http://127.0.0.1:{services['buffer']}/metrics")
    for series in (
        "flywheel_buffer_version",
        "flywheel_buffer_capacity_groups",
        "flywheel_buffer_invariant_ok",
    ):
        assert f"\n{series} " in body.decode(), series
