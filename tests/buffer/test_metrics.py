"""Buffer metrics (services/buffer/metrics.py): names, the documented table, snapshot values."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from services.buffer import metrics as metrics_module
from services.buffer.metrics import build_metrics
from services.buffer.store import StatsSnapshot


def snapshot(**kw: int) -> StatsSnapshot:
    base = dict(
        version=3,
        put=10,
        admitted=8,
        acked=4,
        claimed=6,
        duplicate=1,
        redelivered=1,
        dropped={"stale_at_put": 1, "stale_at_claim": 1, "filtered": 1, "invalid": 0},
        pending=1,
        in_flight=2,
        stored_bytes=300,
        capacity=5,
        running=1,
        accepted=7,
        retained=0,
        reservations_expired=0,
    )
    return StatsSnapshot(**{**base, **kw})  # type: ignore[arg-type]


def exported(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_every_documented_metric_is_registered() -> None:
    m = build_metrics()
    names = set(m.registry._names_to_collectors)  # noqa: SLF001 - the registry's own index
    documented = set(
        re.findall(r"`(flywheel_buffer_[a-z_]+)(?:\{[^}]*\})?`", metrics_module.__doc__ or "")
    )
    assert len(documented) >= 20
    assert documented <= names, documented - names


def test_no_made_up_values_before_the_first_snapshot() -> None:
    m = build_metrics()
    text = generate_latest(m.registry).decode()
    assert "# TYPE flywheel_buffer_put_groups_total counter" in text
    values = exported(text)
    assert "flywheel_buffer_put_groups_total" not in values
    assert "flywheel_buffer_invariant_ok" not in values


def test_snapshot_values_and_invariant_gauge() -> None:
    m = build_metrics()
    m.snapshot.update(snapshot())  # 10 = 4 acked + 3 dropped + 1 pending + 2 in flight
    v = exported(generate_latest(m.registry).decode())
    assert v["flywheel_buffer_put_groups_total"] == 10
    assert v['flywheel_buffer_dropped_groups_total{reason="filtered"}'] == 1
    assert v["flywheel_buffer_stored_groups"] == 3
    assert v["flywheel_buffer_invariant_ok"] == 1
    m.snapshot.update(snapshot(put=11))  # one put unaccounted for
    v = exported(generate_latest(m.registry).decode())
    assert v["flywheel_buffer_invariant_ok"] == 0
