"""Prometheus metrics of the buffer (`flywheel_buffer_*`), on the service's own registry.

Two kinds, on purpose. The accounting (puts, acks, drops by reason, pending, in flight,
capacity, version) lives in Redis, so it is exported from the latest Redis snapshot by a
custom collector: it survives a buffer restart and every replica reports the same truth.
What only this process can see (RPC latency, staleness of what it served, Redis errors,
backpressure refusals) uses ordinary process-local instruments.

| metric | meaning | a bad trend means |
| --- | --- | --- |
| `flywheel_buffer_put_groups_total` | groups put and decided (admitted or dropped) | flat: rollout is stuck |
| `flywheel_buffer_acked_groups_total` | groups acknowledged after an optimizer step | flat: trainer is stuck |
| `flywheel_buffer_claimed_groups_total` | groups handed to trainers (incl. redeliveries) | far above acked: trainers die mid-step |
| `flywheel_buffer_dropped_groups_total{reason}` | dropped: stale_at_put, stale_at_claim, filtered, invalid | stale rising: raise `max_head_offpolicyness` or speed up training |
| `flywheel_buffer_duplicate_puts_total` | retried puts that stored nothing | rising: producers time out too early |
| `flywheel_buffer_redelivered_groups_total` | claims redelivered after `claim_idle_ms` | rising: trainer crashes or steps longer than the idle time |
| `flywheel_buffer_pending_groups` | stored, waiting for a trainer | growing: trainer slower than rollout |
| `flywheel_buffer_in_flight_groups` | claimed, not yet acknowledged | stuck high: a consumer died |
| `flywheel_buffer_stored_groups` / `_stored_bytes` | held in Redis (pending + in flight) | near the limits: backpressure soon |
| `flywheel_buffer_capacity_groups` | groups rollout may still start (AReaL rule) | 0 for long: rollout idles, staleness budget too small |
| `flywheel_buffer_reserved_groups` | reservations outstanding (AReaL "running") | stuck high: rollouts died holding reservations |
| `flywheel_buffer_version` | the trainer's current version | flat: no optimizer steps |
| `flywheel_buffer_max_head_offpolicyness` | η as configured | (a constant; alerts compare against it) |
| `flywheel_buffer_admitted_groups_total` / `_accepted_groups` | admitted at put / admitted and not dropped later | accepted far below admitted: many stale at claim |
| `flywheel_buffer_stats_age_seconds` | age of the Redis snapshot behind these metrics | growing: Redis unreachable |
| `flywheel_buffer_invariant_ok` | 1 when put = acked + dropped + pending + in_flight | 0: accounting broken, investigate |
| `flywheel_buffer_served_staleness_versions` | version - oldest token version of served groups | mass above 0 grows: training on older data |
| `flywheel_buffer_rpc_seconds{method}` | RPC latency | p99 rising: Redis or network slow |
| `flywheel_buffer_rpc_errors_total{method,code}` | RPCs answered with an error status | any UNAVAILABLE: Redis down |
| `flywheel_buffer_redis_errors_total` | Redis calls that failed | rising: Redis unreachable or overloaded |
| `flywheel_buffer_redis_up` | 1 while Redis answers | 0: buffer NOT_SERVING |
| `flywheel_buffer_redis_auth_failed` | 1 while Redis refuses the buffer's password (from the first attempt on) | 1: `buffer.redis_password` / `FLYWHEEL_REDIS_PASSWORD` (or the password in `buffer.redis_url`) is not Redis's `requirepass`; the buffer stays NOT_SERVING |
| `flywheel_buffer_refused_requests_total{method,field}` | requests refused by the buffer's bounds: ids, versions (`SetVersion`'s jump too), counts per call, Claim's size and wait | any: a producer with a bug, or a client probing the buffer |
| `flywheel_buffer_backpressure_total` | puts refused because the buffer was full | rising: trainer cannot keep up |
| `flywheel_buffer_redis_lost_puts_total` | puts that Redis lost in a crash (put counter went back) | any: Redis lost its last writes |
| `flywheel_buffer_read_cache_total{result}` | claimed groups whose bytes came from this replica's memory (hit) or Redis (miss) | many misses: `read_cache_bytes` too small, or puts go through another replica |
| `flywheel_buffer_read_cache_bytes` | payload bytes held in this replica's read cache | (bounded by `buffer.read_cache_bytes`) |
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.buffer.store import DROP_REASONS, StatsSnapshot
from services.common.grpc_server import AuthFailureMetrics

P = "flywheel_buffer"


# Metrics read from the Redis snapshot: name -> help. Counters get `_total` appended.
SNAPSHOT_COUNTERS = {
    "put_groups": "Groups put and decided (admitted or dropped), from Redis.",
    "acked_groups": "Groups acknowledged after an optimizer step.",
    "claimed_groups": "Groups handed to trainer consumers (redeliveries included).",
    "duplicate_puts": "Retried puts that stored nothing.",
    "redelivered_groups": "Claims redelivered after buffer.claim_idle_ms.",
    "admitted_groups": "Groups admitted (stored) at put.",
}
SNAPSHOT_GAUGES = {
    "pending_groups": "Stored groups waiting for a trainer.",
    "in_flight_groups": "Claimed groups not yet acknowledged.",
    "stored_groups": "Groups held in Redis (pending + in flight).",
    "stored_bytes": "Payload bytes held in Redis.",
    "capacity_groups": "Groups the rollout may still start (AReaL rule).",
    "reserved_groups": "Capacity reservations outstanding (AReaL running).",
    "accepted_groups": "Admitted groups not dropped later (AReaL accepted).",
    "version": "The trainer's current policy version.",
    "invariant_ok": "1 when put = acked + dropped + pending + in_flight.",
    "stats_age_seconds": "Age of the Redis snapshot behind these metrics.",
}


class SnapshotCollector(Collector):
    """Exports the latest Redis accounting snapshot. Before the first snapshot the families
    are present without samples: names are discoverable, and no made-up zero is reported."""

    def __init__(self) -> None:
        self.snapshot: StatsSnapshot | None = None
        self.taken_at = 0.0

    def update(self, snapshot: StatsSnapshot) -> None:
        self.snapshot = snapshot
        self.taken_at = time.time()

    def describe(self) -> Iterator:
        return self._families(None)

    def collect(self) -> Iterator:
        return self._families(self.snapshot)

    def _families(self, s: StatsSnapshot | None) -> Iterator:
        counters: dict[str, float | None] = {
            "put_groups": s.put if s else None,
            "acked_groups": s.acked if s else None,
            "claimed_groups": s.claimed if s else None,
            "duplicate_puts": s.duplicate if s else None,
            "redelivered_groups": s.redelivered if s else None,
            "admitted_groups": s.admitted if s else None,
        }
        for name, value in counters.items():
            yield CounterMetricFamily(f"{P}_{name}", SNAPSHOT_COUNTERS[name], value=value)
        dropped = CounterMetricFamily(
            f"{P}_dropped_groups", "Groups dropped without training, by reason.", labels=["reason"]
        )
        if s is not None:
            for reason in sorted(set(DROP_REASONS) | set(s.dropped)):
                dropped.add_metric([reason], s.dropped.get(reason, 0))
        yield dropped
        gauges: dict[str, float | None] = {
            "pending_groups": s.pending if s else None,
            "in_flight_groups": s.in_flight if s else None,
            "stored_groups": s.stored_groups if s else None,
            "stored_bytes": s.stored_bytes if s else None,
            "capacity_groups": s.capacity if s else None,
            "reserved_groups": s.running if s else None,
            "accepted_groups": s.accepted if s else None,
            "version": s.version if s else None,
            "invariant_ok": int(s.invariant_ok) if s else None,
            "stats_age_seconds": time.time() - self.taken_at if s else None,
        }
        for name, value in gauges.items():
            yield GaugeMetricFamily(f"{P}_{name}", SNAPSHOT_GAUGES[name], value=value)


class BufferMetrics:
    """Every buffer instrument, registered on one isolated registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.snapshot = SnapshotCollector()
        registry.register(self.snapshot)
        self.rpc_seconds = Histogram(
            f"{P}_rpc_seconds",
            "Latency of buffer RPCs.",
            ["method"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
            registry=registry,
        )
        self.rpc_errors = Counter(
            f"{P}_rpc_errors_total",
            "RPCs answered with an error status.",
            ["method", "code"],
            registry=registry,
        )
        self.served_staleness = Histogram(
            f"{P}_served_staleness_versions",
            "current version - oldest token version, of each group served to a trainer.",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32, 64),
            registry=registry,
        )
        self.redis_errors = Counter(
            f"{P}_redis_errors_total", "Redis calls that failed.", registry=registry
        )
        self.redis_up = Gauge(f"{P}_redis_up", "1 while Redis answers.", registry=registry)
        self.refused = Counter(
            f"{P}_refused_requests_total",
            "Requests refused by the bounds on ids, versions, counts, Claim size and wait.",
            ["method", "field"],
            registry=registry,
        )
        self.backpressure = Counter(
            f"{P}_backpressure_total",
            "Puts refused with RESOURCE_EXHAUSTED because the buffer was full.",
            registry=registry,
        )
        self.put_results = Counter(
            f"{P}_put_results_total",
            "Put answers of this replica by admission result.",
            ["result"],
            registry=registry,
        )
        self.max_head_offpolicyness = Gauge(
            f"{P}_max_head_offpolicyness",
            "eta: the most versions a served group's oldest token may lag (configured).",
            registry=registry,
        )
        self.lost_puts = Counter(
            f"{P}_redis_lost_puts_total",
            "Puts Redis lost in a crash: its put counter went back below what we had seen.",
            registry=registry,
        )
        self.read_cache = Counter(
            f"{P}_read_cache_total",
            "Claimed groups whose bytes came from this replica's memory (hit) or Redis (miss).",
            ["result"],
            registry=registry,
        )
        self.read_cache_bytes = Gauge(
            f"{P}_read_cache_bytes",
            "Payload bytes held in this replica's read cache.",
            registry=registry,
        )
        self.redis_auth_failed = Gauge(
            f"{P}_redis_auth_failed",
            "1 while Redis refuses the buffer's credentials (wrong or missing password).",
            registry=registry,
        )
        self.auth = AuthFailureMetrics("buffer", registry)


def build_metrics(registry: CollectorRegistry | None = None) -> BufferMetrics:
    """Every buffer metric on a fresh (or the given) isolated registry."""
    return BufferMetrics(
        registry if registry is not None else CollectorRegistry(auto_describe=True)
    )
