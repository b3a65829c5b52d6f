"""Prometheus series of the reward service, on the service's own registry.

| name | type | labels | a bad trend means |
| --- | --- | --- | --- |
| `flywheel_reward_score_seconds` | histogram | fn | a verifier getting slower (long completions, hard LaTeX) |
| `flywheel_reward_results_total` | counter | fn, status | TIMEOUT/ERROR growing: rewards the rollout will zero or drop |
| `flywheel_reward_queue_items` | gauge | | items waiting for a worker; growing = too few workers |
| `flywheel_reward_workers_ready` | gauge | | live workers; below the configured count = restarts piling up |
| `flywheel_reward_worker_restarts_total` | counter | reason | timeout / crash / memory / cpu: which limit the functions hit |
| `flywheel_reward_worker_start_failures_total` | counter | | workers that could not start (import error, start timeout); gRPC health is NOT_SERVING while none is up |
| `flywheel_reward_descendants_killed_total` | counter | | processes reward functions started that still ran when their worker was killed or died, killed with it: functions leave helpers running or hang in them |
| `flywheel_reward_cache_hits_total` | counter | | (with misses) the cache's hit ratio |
| `flywheel_reward_cache_misses_total` | counter | | |
| `flywheel_reward_deduplicated_requests_total` | counter | | retries answered from the request-id store |
| `flywheel_reward_rejected_requests_total` | counter | reason | too_large / queue_full / invalid: callers misconfigured or overloading |
| `flywheel_reward_request_seconds` | histogram | rpc | end-to-end latency of Score / ScoreBatch |
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.grpc_server import AuthFailureMetrics
from services.common.metrics import metric_name, new_registry

_SCORE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)
_REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _n(what: str, unit: str = "") -> str:
    return metric_name("reward", what, unit)


class RewardMetrics:
    """All series in one object so the pool and the servicer share one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
        self.score_seconds = Histogram(
            _n("score", "seconds"),
            "Time one reward function call took in its worker (until killed, for timeouts).",
            ["fn"],
            buckets=_SCORE_BUCKETS,
            registry=r,
        )
        self.results = Counter(
            _n("results"), "Scored items by function and status.", ["fn", "status"], registry=r
        )
        self.queue_items = Gauge(_n("queue", "items"), "Items waiting for a worker.", registry=r)
        self.workers_ready = Gauge(_n("workers", "ready"), "Worker processes ready.", registry=r)
        self.worker_restarts = Counter(
            _n("worker_restarts"),
            "Workers killed or lost and replaced, by reason.",
            ["reason"],
            registry=r,
        )
        self.worker_start_failures = Counter(
            _n("worker_start_failures"),
            "Worker processes that failed to start (retried with back-off).",
            registry=r,
        )
        self.descendants_killed = Counter(
            _n("descendants_killed"),
            "Processes reward functions started, still running when their worker was "
            "killed or died, killed with it.",
            registry=r,
        )
        self.cache_hits = Counter(_n("cache_hits"), "Results served from the cache.", registry=r)
        self.cache_misses = Counter(
            _n("cache_misses"), "Cache lookups that had to score.", registry=r
        )
        self.deduplicated = Counter(
            _n("deduplicated_requests"),
            "Requests answered from the request-id store (retries).",
            registry=r,
        )
        self.rejected = Counter(
            _n("rejected_requests"), "Requests refused, by reason.", ["reason"], registry=r
        )
        self.auth = AuthFailureMetrics("reward", r)
        self.request_seconds = Histogram(
            _n("request", "seconds"),
            "End-to-end RPC latency.",
            ["rpc"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        # Labelled children, looked up once: `labels()` per scored item is measurable.
        self._score_children: dict[str, Any] = {}
        self._result_children: dict[tuple[str, str], Any] = {}

    def score_seconds_of(self, fn: str) -> Any:
        child = self._score_children.get(fn)
        if child is None:
            child = self._score_children[fn] = self.score_seconds.labels(fn=fn)
        return child

    def result(self, fn: str, status: str) -> None:
        child = self._result_children.get((fn, status))
        if child is None:
            child = self._result_children[(fn, status)] = self.results.labels(fn=fn, status=status)
        child.inc()
