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
    """gRPC port; 0 picks a free port (local runs)."""

    metrics_port: int = Field(default=0, ge=0, le=65535)
    """HTTP port of /metrics, /healthz and /readyz; 0 picks a free port."""

    @property
    def address(self) -> str:
        """`host:port` for gRPC clients."""
        return f"{self.host}:{self.port}"


def _endpoint(port: int, metrics_port: int) -> EndpointConfig:
    return EndpointConfig(port=port, metrics_port=metrics_port)


def _token_from_env() -> str | None:
    return os.environ.get("FLYWHEEL_TOKEN") or None


class ServicesConfig(FlywheelModel):
    """Network settings shared by every service."""

    rollout: EndpointConfig = Field(default_factory=lambda: _endpoint(50051, 9101))
    """Rollout service (replica i uses `port + i` and `metrics_port + i`)."""

    reward: EndpointConfig = Field(default_factory=lambda: _endpoint(50052, 9102))
    """Reward service."""

    buffer: EndpointConfig = Field(default_factory=lambda: _endpoint(50053, 9103))
    """Buffer service."""

    trainer: EndpointConfig = Field(default_factory=lambda: _endpoint(50054, 9104))
    """Trainer service (rank 0)."""

    auth_token: str | None = Field(default_factory=_token_from_env)
    """Bearer token every RPC must carry; defaults to `$FLYWHEEL_TOKEN`; null disables auth."""

    max_message_bytes: int = Field(default=64 << 20, ge=4 << 20)
    """Largest gRPC message sent or received (the 4 MiB gRPC default is too small for
    real trajectory groups)."""
