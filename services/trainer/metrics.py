"""Prometheus metrics of the trainer (`flywheel_trainer_*`) and the per-step JSON lines.

Gauges hold the last step's value of the training-health statistics that the algorithm
core computes (names from `services.trainer.algorithms.stats.STATS`); histograms and
counters hold what accumulates (durations, staleness, skipped steps, unhealthy replicas).
Every instrument lives on the registry passed in, never the global default.

A statistic gauge (`importance_weight`, `task_reward`, `tokens_per_second`, ...) is absent
until the step that first sets it: a trainer that has not trained since it (re)started
reports no value rather than a 0 that alert rules would read as a real one. Only global
rank 0 exports these series; the other trainer pods serve an empty `/metrics` (their
ranks compute no statistics of their own).

| metric | meaning | a bad trend means |
| --- | --- | --- |
| `flywheel_trainer_version` | policy version after the last step | flat: no optimizer rounds |
| `flywheel_trainer_steps_total` | training steps completed | flat: trainer stuck (waiting for data?) |
| `flywheel_trainer_skipped_updates_total` | optimizer steps skipped on a non-finite grad norm | any: lr too high, fp16 overflow, bad data |
| `flywheel_trainer_importance_weight` | mean pi_theta/pi_prox | far from 1: updates too large |
| `flywheel_trainer_behave_imp_weight` | mean pi_prox/pi_behave (decoupled loss) | far from 1: stale data or engine mismatch |
| `flywheel_trainer_no_eos_ratio` | fraction of truncated completions | rising: completions hit max_new_tokens |
| `flywheel_trainer_seq_len_tokens` | mean prompt+completion length | exploding/collapsing: reward hacking |
| `flywheel_trainer_response_len_tokens` | mean completion length | same |
| `flywheel_trainer_task_reward` | mean outcome reward | flat: nothing learnt |
| `flywheel_trainer_clip_ratio` / `_dual_clip_ratio` | fraction of tokens where the clip binds | high: lr too high or eps too tight |
| `flywheel_trainer_approx_kl` | mean log pi_theta - log pi_prox | growing: step size too large |
| `flywheel_trainer_entropy` | mean token entropy | collapsing: no exploration left |
| `flywheel_trainer_grad_norm` | global gradient norm before clipping | spikes: instability |
| `flywheel_trainer_lr` | learning rate of the last optimizer step | — |
| `flywheel_trainer_loss` | actor loss of the last step | — |
| `flywheel_trainer_stat{name}` | every other documented statistic (prox errors, KL, ...) | see docs/algorithms.md |
| `flywheel_trainer_staleness_versions` | per-sequence v_train - oldest v_behave | mass beyond eta: admission broken |
| `flywheel_trainer_step_seconds` | wall time of one step, from batch in hand to weights published (with a background publication, `trainer.overlap_weight_publication`, to the publication handed off; waiting for data is the `wait_batch` phase) | rising: slower steps |
| `flywheel_trainer_phase_seconds{phase}` | wait_batch, ref, teacher, values, prox, advantages, train, ack, broadcast, publish_wait (waiting for the previous background publication), checkpoint | which phase dominates |
| `flywheel_trainer_tokens_per_second` | trained tokens / train-phase seconds | falling: throughput regression |
| `flywheel_trainer_trained_tokens_total` / `_samples_total` | trained tokens / trajectories | — |
| `flywheel_trainer_weight_broadcast_seconds{transport}` | time to make every replica serve v+1 | rising: transport bottleneck |
| `flywheel_trainer_unhealthy_replicas_total` | replica updates that failed and were skipped | any: a rollout replica is down |
| `flywheel_trainer_weight_parity_max_abs_logprob_diff{replica}` | largest absolute log-probability difference between the replica and the trainer on the parity probe after the last update (services/trainer/parity.py) | above the tolerance (1e-3 in float32): the replica computes with different weights; it is paused |
| `flywheel_trainer_weight_parity_tolerance` | the probe's tolerance for the published weight dtype (0: no probe) | — |
| `flywheel_trainer_prox_forwards_total` | proximal-logprob forward passes | >0 with loglinear: misconfigured |
| `flywheel_trainer_checkpoints_total` | checkpoints written | — |
| `flywheel_trainer_peer_unavailable_seconds_total{peer}` | seconds the `buffer` (or Redis behind it) or a replica `rollout-<i>` did not answer | rising: that peer is down; the trainer waits and retries (services/common/outage.py) |
| `flywheel_trainer_peer_unavailable{peer}` | 1 while the last call to `peer` found no server | 1 for long: the trainer is waiting on it |
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from services.common.grpc_server import AuthFailureMetrics
from services.common.outage import PeerOutageMetrics

P = "flywheel_trainer"

# stat name -> metric name suffix: the signals users watch get a metric of their own.
NAMED_STATS: dict[str, str] = {
    "importance_weight/avg": "importance_weight",
    "behave_imp_weight/avg": "behave_imp_weight",
    "no_eos_ratio": "no_eos_ratio",
    "seq_len": "seq_len_tokens",
    "response_len": "response_len_tokens",
    "task_reward": "task_reward",
    "clip_ratio/avg": "clip_ratio",
    "dual_clip_ratio/avg": "dual_clip_ratio",
    "approx_kl/avg": "approx_kl",
    "entropy/avg": "entropy",
    "grad_norm": "grad_norm",
    "lr": "lr",
    "loss": "loss",
}

PHASES = (
    "wait_batch",
    "ref",
    "teacher",
    "values",
    "prox",
    "advantages",
    "train",
    "critic_train",
    "ack",
    "broadcast",
    "checkpoint",
)
_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 16, 32, 64)


class _SetGauges:
    """Collector of unlabelled gauges that exports each one only once it has been set."""

    def __init__(self) -> None:
        self.gauges: list[Gauge] = []
        self._set: set[int] = set()

    def add(self, name: str, documentation: str) -> Gauge:
        gauge = Gauge(name, documentation, registry=None)
        self.gauges.append(gauge)
        return gauge

    def set(self, gauge: Gauge, value: float) -> None:
        gauge.set(value)
        self._set.add(id(gauge))

    def describe(self) -> list[Metric]:
        return [m for g in self.gauges for m in g.describe()]

    def collect(self) -> list[Metric]:
        return [m for g in self.gauges if id(g) in self._set for m in g.collect()]


class TrainerMetrics:
    """All trainer instruments on one registry (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.version = Gauge(f"{P}_version", "Policy version after the last step.", registry=r)
        self.steps = Counter(f"{P}_steps", "Training steps completed.", registry=r)
        self.skipped = Counter(
            f"{P}_skipped_updates", "Optimizer steps skipped: non-finite grad norm.", registry=r
        )
        self._stats = _SetGauges()
        self.named = {
            stat: self._stats.add(f"{P}_{suffix}", f"Last step's `{stat}` statistic.")
            for stat, suffix in NAMED_STATS.items()
        }
        self.other = Gauge(
            f"{P}_stat", "Last step's value of other documented statistics.", ["name"], registry=r
        )
        self.staleness = Histogram(
            f"{P}_staleness_versions",
            "Per trained sequence: trainer version - oldest behaviour version of its tokens.",
            buckets=_STALENESS_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            f"{P}_step_seconds",
            "Wall time of one training step.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.phase_seconds = Histogram(
            f"{P}_phase_seconds",
            "Wall time of each phase of a step.",
            ["phase"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.tokens_per_second = self._stats.add(
            f"{P}_tokens_per_second", "Trained tokens per second of the train phase."
        )
        r.register(self._stats)
        self.tokens = Counter(f"{P}_trained_tokens", "Tokens trained on.", registry=r)
        self.samples = Counter(f"{P}_trained_samples", "Trajectories trained on.", registry=r)
        self.broadcast_seconds = Histogram(
            f"{P}_weight_broadcast_seconds",
            "Seconds from weights ready to every replica serving them.",
            ["transport"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.unhealthy = Counter(
            f"{P}_unhealthy_replicas",
            "Replica weight updates that failed; the replica was skipped for that version.",
            registry=r,
        )
        self.weight_parity = Gauge(
            f"{P}_weight_parity_max_abs_logprob_diff",
            "Largest |log p| difference between a replica and the trainer on the parity probe.",
            ["replica"],
            registry=r,
        )
        self.weight_parity_tolerance = Gauge(
            f"{P}_weight_parity_tolerance",
            "The parity probe's tolerance: a replica above it is unhealthy (0: no probe).",
            registry=r,
        )
        self.prox_forwards = Counter(
            f"{P}_prox_forwards", "Forward passes run to recompute proximal logprobs.", registry=r
        )
        self.checkpoints = Counter(f"{P}_checkpoints", "Checkpoints written.", registry=r)
        self.peers = PeerOutageMetrics("trainer", r)
        self.auth = AuthFailureMetrics("trainer", r)

    def observe_step(self, record: Mapping[str, Any]) -> None:
        """Export one step's record (the same dict that goes to metrics.jsonl)."""
        self.steps.inc()
        self.version.set(record["version"])
        for name, value in record.get("stats", {}).items():
            if not isinstance(value, int | float):
                continue
            if name in self.named:
                self._stats.set(self.named[name], value)
            else:
                self.other.labels(name=name).set(value)
        for key in ("loss", "grad_norm", "lr", "task_reward", "no_eos_ratio"):
            if isinstance(record.get(key), int | float):
                self._stats.set(self.named[key], record[key])
        for s in record.get("staleness_per_seq", ()):
            self.staleness.observe(s)
        self.step_seconds.observe(record["step_seconds"])
        for phase, seconds in record.get("phase_seconds", {}).items():
            self.phase_seconds.labels(phase=phase).observe(seconds)
        if record.get("tokens_per_second"):
            self._stats.set(self.tokens_per_second, record["tokens_per_second"])
        self.tokens.inc(record.get("tokens", 0))
        self.samples.inc(record.get("samples", 0))
        self.skipped.inc(record.get("skipped_updates", 0))
        self.prox_forwards.inc(record.get("prox_forwards", 0))


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most one line and
    readers (the launcher's progress bar, plots) can tail the file while training runs."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps({**record, "wall_time": record.get("wall_time", time.time())})
        with self.path.open("a") as fh:
            fh.write(line + "\n")
            fh.flush()
