"""Prometheus metrics of one rollout replica (`flywheel_rollout_*`, isolated registry).

| name | type | what a bad trend means |
| --- | --- | --- |
| `flywheel_rollout_generated_tokens_total` | counter | flat: generation stalled (paused, no capacity, engine stuck) |
| `flywheel_rollout_generated_tokens_per_second` | gauge | falling: slower engine or more waiting on capacity/updates |
| `flywheel_rollout_requests_in_flight` | gauge | at the batch size for long: engine saturated; 0 while groups are wanted: starved |
| `flywheel_rollout_groups_in_flight` | gauge | groups being generated/scored now (≤ max_concurrent_rollouts) |
| `flywheel_rollout_groups_produced_total` | counter | flat while tokens grow: every group fails or is rejected |
| `flywheel_rollout_groups_rejected_total{reason}` | counter | `stale` rising: η too small or weights pushed too slowly; `filtered`: rewards all equal; `reward_failure`, `error`, `put_failed`: see logs |
| `flywheel_rollout_weight_version` | gauge | lagging the trainer's version: weight pushes fail or are slow |
| `flywheel_rollout_weight_update_seconds{transport}` | histogram | growing: transport or checksum verification got slower |
| `flywheel_rollout_weight_update_pause_seconds{transport}` | histogram | growing: decoding held longer per update (throughput lost) |
| `flywheel_rollout_weight_updates_total{transport,result}` | counter | `result="failed"` rising: corrupt/partial/mismatched updates (old weights kept) |
| `flywheel_rollout_no_eos_ratio` | gauge | rising: completions truncated by max_new_tokens (length), reward often 0 |
| `flywheel_rollout_completions_total{stop_reason}` | counter | `length`/`abort` share rising: see no-EOS ratio |
| `flywheel_rollout_reward_failures_total{status}` | counter | `TIMEOUT`/`ERROR` rising: reward function slow or broken |
| `flywheel_rollout_task_reward` | gauge | mean reward of the last group produced |
| `flywheel_rollout_paused` | gauge | 1 for long: the trainer paused generation (sync mode) or a drain is stuck |
| `flywheel_rollout_images_per_group` | histogram | images of each prompt with images (`rollout.workflow: vision_rlvr`); at the bound (8): rows near the limit the buffer enforces |
| `flywheel_rollout_image_tokens_per_sample` | histogram | image tokens in each sample's prompt; growing: larger images (the processor's `max_pixels`) and longer prefills |
| `flywheel_rollout_processor_seconds` | histogram | time the model's processor took per prompt with images; growing: larger images or a starved CPU, generation waits on it |
| `flywheel_rollout_peer_unavailable_seconds_total{peer}` | counter | rising: the `buffer` or `reward` service (or Redis behind the buffer) is down; calls wait and retry (services/common/outage.py) |
| `flywheel_rollout_peer_unavailable{peer}` | gauge | 1: the last call to `peer` found no server |
| `flywheel_rollout_openai_requests_total{endpoint,status}` | counter | 4xx share rising: clients send what the API refuses (see the error bodies) |
| `flywheel_rollout_tool_call_parse_failures_total` | counter | rising: the policy writes `<tool_call>` blocks that are not valid JSON calls |
| `flywheel_rollout_template_drift_total` | counter | above 0: a session call's prompt did not extend the previous prompt + output (the template re-renders earlier turns) |
| `flywheel_rollout_session_prefill_tokens_total` | counter | prompt tokens of session calls (what is prefilled without reuse) |
| `flywheel_rollout_session_reused_prefix_tokens_total` | counter | of those, tokens equal to the previous call's prompt + output (reusable KV); a falling share: drift |
| `flywheel_rollout_sessions_open` | gauge | at the session bound for long: agents do not close their sessions |
| `flywheel_rollout_agent_episodes_total` | counter | agent episodes that finished with a reward (`rollout.workflow: agent`) |
| `flywheel_rollout_agent_episode_failures_total{reason}` | counter | rising: `error` (the agent raised), `timeout`, `max_turns`, `token_budget`, `context_budget`, `no_calls`, `bad_reward`, `reward_failed`; the episode is dropped from its group (docs/agents.md) |
| `flywheel_rollout_agent_episode_seconds` | histogram | growing: longer episodes (more turns, slower tools or engine) |
| `flywheel_rollout_agent_episode_turns` | histogram | model calls per finished episode; stuck at `max_turns`: the agent never concludes |
| `flywheel_rollout_agent_turns_total` | counter | model calls of finished episodes |
| `flywheel_rollout_agent_tool_calls_total{tool,outcome}` | counter | `timeout`/`memory`/`cpu`/`error` share rising: tools fail (bad arguments from the policy, or limits too tight) |
"""

from __future__ import annotations

import collections
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.grpc_server import AuthFailureMetrics
from services.common.outage import PeerOutageMetrics

_UPDATE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class RolloutMetrics:
    """All rollout metrics on one registry; build a fresh one per replica (or per test)."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, no_eos_window: int = 256
    ) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.generated_tokens = Counter(
            "flywheel_rollout_generated_tokens", "Tokens generated by the engine.", registry=r
        )
        self.tokens_per_second = Gauge(
            "flywheel_rollout_generated_tokens_per_second",
            "Generated tokens per second over the last sampling interval.",
            registry=r,
        )
        self.requests_in_flight = Gauge(
            "flywheel_rollout_requests_in_flight",
            "Generation requests accepted by the engine and not finished.",
            registry=r,
        )
        self.groups_in_flight = Gauge(
            "flywheel_rollout_groups_in_flight", "Groups being generated or scored.", registry=r
        )
        self.groups_produced = Counter(
            "flywheel_rollout_groups_produced", "Groups stored by the buffer.", registry=r
        )
        self.groups_rejected = Counter(
            "flywheel_rollout_groups_rejected",
            "Groups not stored, by reason.",
            ["reason"],
            registry=r,
        )
        self.weight_version = Gauge(
            "flywheel_rollout_weight_version", "Policy version of the served weights.", registry=r
        )
        self.update_seconds = Histogram(
            "flywheel_rollout_weight_update_seconds",
            "Wall time of a weight update (receive, verify, apply).",
            ["transport"],
            buckets=_UPDATE_BUCKETS,
            registry=r,
        )
        self.update_pause_seconds = Histogram(
            "flywheel_rollout_weight_update_pause_seconds",
            "Time decoding was held while new weights were swapped in.",
            ["transport"],
            buckets=_UPDATE_BUCKETS,
            registry=r,
        )
        self.weight_updates = Counter(
            "flywheel_rollout_weight_updates",
            "Weight updates by transport and result (ok|failed).",
            ["transport", "result"],
            registry=r,
        )
        self.no_eos_ratio = Gauge(
            "flywheel_rollout_no_eos_ratio",
            "Share of recent completions that ended without EOS/stop (length or abort).",
            registry=r,
        )
        self.completions = Counter(
            "flywheel_rollout_completions",
            "Completions by stop reason.",
            ["stop_reason"],
            registry=r,
        )
        self.reward_failures = Counter(
            "flywheel_rollout_reward_failures",
            "Completions whose reward could not be computed, by status.",
            ["status"],
            registry=r,
        )
        self.task_reward = Gauge(
            "flywheel_rollout_task_reward", "Mean reward of the last group produced.", registry=r
        )
        self.paused = Gauge("flywheel_rollout_paused", "1 while generation is paused.", registry=r)
        self.images_per_group = Histogram(
            "flywheel_rollout_images_per_group",
            "Images of each prompt with images (vision_rlvr); a group carries them once.",
            buckets=(1, 2, 3, 4, 6, 8, 16),
            registry=r,
        )
        self.image_tokens_per_sample = Histogram(
            "flywheel_rollout_image_tokens_per_sample",
            "Image tokens in the prompt of each sample (every sample of a group shares it).",
            buckets=(16, 64, 256, 1024, 4096, 16384),
            registry=r,
        )
        self.processor_seconds = Histogram(
            "flywheel_rollout_processor_seconds",
            "Seconds the model's processor took to build one prompt with images.",
            buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0),
            registry=r,
        )
        self.peers = PeerOutageMetrics("rollout", r)
        self.auth = AuthFailureMetrics("rollout", r)
        self.openai_api = OpenAIApiCounters(r)
        self.agent = AgentMetrics(r)
        self._recent_no_eos: collections.deque[bool] = collections.deque(maxlen=no_eos_window)
        self._last_tokens = 0
        self._counted_tokens = 0
        self._last_time = time.monotonic()

    def observe_completion(self, stop_reason: str) -> None:
        self.completions.labels(stop_reason=stop_reason).inc()
        self._recent_no_eos.append(stop_reason != "stop")
        self.no_eos_ratio.set(sum(self._recent_no_eos) / len(self._recent_no_eos))

    def observe_images(self, images: int, image_tokens: int, processor_seconds: float) -> None:
        """One prompt with images rendered (`WorkflowContext.on_images`)."""
        if images:
            self.images_per_group.observe(images)
            self.image_tokens_per_sample.observe(image_tokens)
            self.processor_seconds.observe(processor_seconds)

    def observe_update(self, transport: str, ok: bool, total_s: float, pause_s: float) -> None:
        self.weight_updates.labels(transport=transport, result="ok" if ok else "failed").inc()
        if ok:
            self.update_seconds.labels(transport=transport).observe(total_s)
            self.update_pause_seconds.labels(transport=transport).observe(pause_s)

    def sync_engine(
        self, tokens_generated: int, in_flight: int, version: int, paused: bool
    ) -> None:
        """Copy the engine's counters in (called periodically and on Stats)."""
        delta = tokens_generated - self._counted_tokens
        if delta > 0:
            self.generated_tokens.inc(delta)
            self._counted_tokens = tokens_generated
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed >= 0.5:
            self.tokens_per_second.set(max(tokens_generated - self._last_tokens, 0) / elapsed)
            self._last_time = now
            self._last_tokens = tokens_generated
        self.requests_in_flight.set(in_flight)
        self.weight_version.set(version)
        self.paused.set(1 if paused else 0)


class OpenAIApiCounters:
    """The OpenAI-compatible API's counters (`services/rollout/openai_api/`), part of
    `RolloutMetrics` (not named `*Metrics`: tools/gen_metrics_docs.py builds every such
    class of this module on its own, which would list these rows twice)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "flywheel_rollout_openai_requests",
            "OpenAI-compatible API calls by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.tool_call_parse_failures = Counter(
            "flywheel_rollout_tool_call_parse_failures",
            "Completions whose tool-call blocks could not be parsed (returned as text).",
            registry=r,
        )
        self.template_drift = Counter(
            "flywheel_rollout_template_drift",
            "Session calls whose prompt did not extend the previous prompt + output.",
            registry=r,
        )
        self.prefill_tokens = Counter(
            "flywheel_rollout_session_prefill_tokens",
            "Prompt tokens of session calls.",
            registry=r,
        )
        self.reused_prefix_tokens = Counter(
            "flywheel_rollout_session_reused_prefix_tokens",
            "Prompt tokens of session calls equal to the previous call's prompt + output.",
            registry=r,
        )
        self.sessions_open = Gauge(
            "flywheel_rollout_sessions_open", "Open OpenAI API sessions.", registry=r
        )

    def observe_call(self, record: Any, n_calls: int) -> None:
        """Account one recorded session call (a `sessions.CallRecord`)."""
        self.prefill_tokens.inc(len(record.prompt_ids))
        self.reused_prefix_tokens.inc(record.reused_prefix_tokens)
        if record.drift:
            self.template_drift.inc()


class AgentMetrics:
    """Episodes of the agent workflow (`services/rollout/workflows/agent.py`) and the tool
    calls their agents made through the sandbox."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.episodes = Counter(
            "flywheel_rollout_agent_episodes", "Agent episodes that finished.", registry=r
        )
        self.failures = Counter(
            "flywheel_rollout_agent_episode_failures",
            "Agent episodes that failed, by reason.",
            ["reason"],
            registry=r,
        )
        self.episode_seconds = Histogram(
            "flywheel_rollout_agent_episode_seconds",
            "Wall time of agent episodes (failed ones included).",
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=r,
        )
        self.turns = Histogram(
            "flywheel_rollout_agent_episode_turns",
            "Model calls per finished agent episode.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.turns_total = Counter(
            "flywheel_rollout_agent_turns", "Model calls of finished agent episodes.", registry=r
        )
        self.tool_calls = Counter(
            "flywheel_rollout_agent_tool_calls",
            "Tool calls of agent episodes by tool and outcome.",
            ["tool", "outcome"],
            registry=r,
        )

    def observe_episode(self, turns: int, seconds: float) -> None:
        self.episodes.inc()
        self.turns.observe(turns)
        self.turns_total.inc(turns)
        self.episode_seconds.observe(seconds)

    def observe_failure(self, reason: str, seconds: float) -> None:
        self.failures.labels(reason=reason).inc()
        self.episode_seconds.observe(seconds)

    def observe_tool_call(self, tool: str, outcome: str) -> None:
        # A tool name comes from the policy's output: bound the label set.
        self.tool_calls.labels(tool=tool[:64], outcome=outcome).inc()


def build_metrics() -> RolloutMetrics:
    """A fresh registry with every rollout metric (dashboards/alerts tests read the names)."""
    return RolloutMetrics()
