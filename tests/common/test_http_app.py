"""The HTTP side app serves the service's own registry and honest readiness."""

from __future__ import annotations

import httpx
from prometheus_client import Counter

from services.common.http_app import MetricsServer
from services.common.metrics import metric_name, new_registry


def test_metrics_health_and_readiness_over_http():
    registry = new_registry()
    counter = Counter(
        metric_name("demo", "events", "total").removesuffix("_total"), "Events.", registry=registry
    )
    counter.inc(3)
    ready = {"value": False}
    server = MetricsServer("demo", registry, lambda: ready["value"])
    port = server.start()
    try:
        base = f"http://127.0.0.1:{port}"
        body = httpx.get(f"{base}/metrics").text
        assert "flywheel_demo_events_total 3.0" in body
        assert "python_gc_objects_collected_total" not in body  # isolated registry
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert httpx.get(f"{base}/readyz").status_code == 503
        ready["value"] = True
        assert httpx.get(f"{base}/readyz").status_code == 200
    finally:
        server.stop()
