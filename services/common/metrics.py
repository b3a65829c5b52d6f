"""Prometheus helpers shared by the services.

Each service owns an isolated `CollectorRegistry` (never the process-global one), so several
services can live in one test process and `/metrics` shows exactly one service's series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def metric_name(service: str, what: str, unit: str = "") -> str:
    """`flywheel_<service>_<what>[_<unit>]`: the naming rule of docs/architecture.md in one place."""
    parts = ["flywheel", service, what] + ([unit] if unit else [])
    return "_".join(parts)
