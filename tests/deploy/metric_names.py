"""The metric names the services export, read from their own registries, and the names a
PromQL expression uses. Shared by the dashboard, alert and scrape tests."""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

# Identifiers that are PromQL keywords/functions, never metric names.
_NAME_RE = re.compile(r"(?<![\w{\"'$:.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{|\[|\)|\s|$|[-+*/><=!]|,)")
_PROMQL_WORDS = {
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "abs",
    "scalar",
    "absent",
    "avg_over_time",
    "max_over_time",
    "min_over_time",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "le",
    "vector",
    "time",
    "clamp_min",
    "clamp_max",
    "delta",
    "deriv",
    "topk",
    "bottomk",
    "quantile",
    "stddev",
    "label_replace",
    "sort",
    "sort_desc",
}


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry exposes, as Prometheus would store it."""
    from prometheus_client import generate_latest

    names: set[str] = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        names.update(s.name for s in family.samples)
        names.update(family_series_names(family.name, family.type))
    return names


def family_series_names(name: str, kind: str) -> set[str]:
    """Series a family produces once it has samples, known before any is observed
    (labelled metrics have no children on a fresh registry). prometheus_client also serves
    `<name>_created` (the child's creation time) for counters, histograms and summaries,
    and Prometheus stores it as a series of its own."""
    if kind == "counter":
        return {name + "_total", name + "_created"}
    if kind == "histogram":
        return {name + "_bucket", name + "_sum", name + "_count", name + "_created"}
    if kind == "summary":
        return {name, name + "_sum", name + "_count", name + "_created"}
    return {name}


def registry_families(registry: CollectorRegistry) -> set[str]:
    """Series names of every family registered, labelled ones without children included."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family_series_names(family.name, family.type))
        names.update(s.name for s in family.samples)
    return names


def names_in(expr: str) -> set[str]:
    """Metric names an expression selects (string literals and label values stripped)."""
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    stripped = re.sub(r"\{[^}]*\}", "{}", stripped)
    stripped = re.sub(r"\[[^\]]*\]", "[]", stripped)
    stripped = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", stripped
    )
    found = {m.group(1) for m in _NAME_RE.finditer(stripped + " ")}
    return {n for n in found if n not in _PROMQL_WORDS and not re.fullmatch(r"[0-9.e]+", n)}


def all_names_in(exprs: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for e in exprs:
        out |= names_in(e)
    return out


def _metrics_classes(module) -> list[type]:  # type: ignore[no-untyped-def]
    return [
        obj
        for name, obj in vars(module).items()
        if isinstance(obj, type) and name.endswith("Metrics") and obj.__module__ == module.__name__
    ]


def exported_names(service: str) -> set[str]:
    """Every series name `services.<service>.metrics` registers, on a fresh registry.

    The buffer exports its Redis accounting through a collector that yields nothing until
    the first snapshot, so one all-zero snapshot is fed to it (as the service does on start).
    """
    import importlib

    module = importlib.import_module(f"services.{service}.metrics")
    classes = _metrics_classes(module)
    assert classes, f"services.{service}.metrics defines no *Metrics class"
    names: set[str] = set()
    for cls in classes:
        registry = CollectorRegistry()
        instance = cls(registry)
        if service == "buffer":
            from services.buffer.store import StatsSnapshot

            instance.snapshot.update(
                StatsSnapshot(
                    version=0,
                    put=0,
                    admitted=0,
                    acked=0,
                    claimed=0,
                    duplicate=0,
                    redelivered=0,
                    dropped={},
                    pending=0,
                    in_flight=0,
                    stored_bytes=0,
                    capacity=0,
                    running=0,
                    accepted=0,
                    retained=0,
                    reservations_expired=0,
                )
            )
        if service == "trainer":
            # Statistic gauges are absent until a step sets them: one step sets them all.
            from services.trainer.metrics import NAMED_STATS

            stats = dict.fromkeys(NAMED_STATS, 1.0)
            instance.observe_step(
                {"version": 1, "step_seconds": 0.1, "tokens_per_second": 1.0, "stats": stats}
            )
        names |= registry_families(registry)
    return names


SERVICES = ("buffer", "reward", "rollout", "trainer")


def all_exported_names() -> set[str]:
    out: set[str] = set()
    for service in SERVICES:
        out |= exported_names(service)
    return out
