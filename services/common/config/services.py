"""Services block: where each service listens and how callers authenticate."""

from __future__ import annotations

import os

from pydantic import Field

from ._base import FlywheelModel


class EndpointConfig(FlywheelModel):
    """Addresses of one service: gRPC and the HTTP side app (/metrics, /healthz)."""

    host: str = "127.0.0.1"
    """Host the service binds to and callers dial (use 0.0.0.0 to bind all interfaces
    in containers; callers then use the service name)."""

    port: int = Field(default=0, ge=0, le=65535)
    """gRPC port; 0 (the default) lets the local launcher pick a free port and write it
    into the resolved config; deployments (compose, Helm) set fixed ports."""

    metrics_port: int = Field(default=0, ge=0, le=65535)
    """HTTP port of /metrics, /healthz and /readyz; 0 lets the launcher pick one."""

    @property
    def address(self) -> str:
        """`host:port` for gRPC clients."""
        return f"{self.host}:{self.port}"


class RolloutEndpointConfig(EndpointConfig):
    """Addresses of the rollout replicas: replica i is `replica_host(i)` on
    `port + port_stride * i` (and `metrics_port + port_stride * i`)."""

    port_stride: int = Field(default=1, ge=0)
    """Port step between replicas: 1 on one host; 0 in containers, where every replica
    has its own IP and listens on the same port."""

    def replica_host(self, index: int) -> str:
        """Host of replica `index`: `host` with `{i}` replaced by the index (a StatefulSet
        pod name such as `flywheel-rollout-{i}.flywheel-rollout-headless`)."""
        return self.host.replace("{i}", str(index))

    def replica_port(self, index: int, kind: str = "port") -> int:
        """gRPC (`kind="port"`) or metrics (`kind="metrics_port"`) port of replica `index`;
        0 stays 0 (pick a free port)."""
        base = self.port if kind == "port" else self.metrics_port
        return 0 if base == 0 else base + self.port_stride * index

    def replica_address(self, index: int) -> str:
        """`host:port` of replica `index` for gRPC clients."""
        return f"{self.replica_host(index)}:{self.replica_port(index)}"


def _token_from_env() -> str | None:
    return os.environ.get("FLYWHEEL_TOKEN") or None


class ServicesConfig(FlywheelModel):
    """Network settings shared by every service."""

    rollout: RolloutEndpointConfig = Field(default_factory=RolloutEndpointConfig)
    """Rollout service; replica i is at `replica_address(i)` (`port + port_stride * i`)."""

    reward: EndpointConfig = Field(default_factory=EndpointConfig)
    """Reward service."""

    buffer: EndpointConfig = Field(default_factory=EndpointConfig)
    """Buffer service."""

    trainer: EndpointConfig = Field(default_factory=EndpointConfig)
    """Trainer service (rank 0)."""

    auth_token: str | None = Field(default_factory=_token_from_env)
    """Bearer token every RPC must carry; defaults to `$FLYWHEEL_TOKEN`; null disables auth."""

    max_message_bytes: int = Field(default=64 << 20, ge=4 << 20)
    """Largest gRPC message sent or received (the 4 MiB gRPC default is too small for
    real trajectory groups)."""

    peer_outage_budget_s: float = Field(default=300.0, gt=0.0)
    """How long a call to the buffer or the reward service keeps trying while that service
    does not answer (UNAVAILABLE, or no answer within the attempt's deadline), with bounded
    exponential back-off, before it fails: a service (or the Redis behind the buffer) that
    restarts within this time costs waiting, not a crash. Counted from the first failed
    attempt of each call; the outage shows as `flywheel_<service>_peer_unavailable_*`.
    Calls from the trainer to rollout replicas keep a budget of seconds: a replica that
    misses a weight update is skipped and brought up to date when it is back."""
