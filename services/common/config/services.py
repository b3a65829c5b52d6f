"""Services block: where each service listens and how callers authenticate."""

from __future__ import annotations

import os

from pydantic import Field, model_validator

from ._base import SECRET, FlywheelModel, RuleViolation


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


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


ROLES = ("admin", "trainer", "rollout", "launcher")
"""Callers that `services.credentials` can name; what each may call is
`services.common.grpc_server.ROLE_METHODS` (docs/security.md has the table)."""


def credentials_from_env() -> dict[str, str]:
    """`FLYWHEEL_CREDENTIALS`: comma-separated `role=token` pairs (the token may be given as
    `sha256:<hex digest>`, so that a server holds no usable token)."""
    raw = os.environ.get("FLYWHEEL_CREDENTIALS", "")
    pairs = [p.strip() for p in raw.split(",") if p.strip()]
    return dict(p.split("=", 1) for p in pairs if "=" in p)


class TLSConfig(FlywheelModel):
    """TLS of every gRPC server and client, from PEM files. The names follow cert-manager's
    Secret keys (`tls.crt`, `tls.key`, `ca.crt`): mount the Secret and point here."""

    cert_file: str | None = Field(default_factory=lambda: _env("FLYWHEEL_TLS_CERT"))
    """PEM certificate chain of this service (`tls.crt`); servers present it, clients
    present it too when the server asks for one (mTLS). Set (with `key_file`) to turn TLS
    on; defaults to `$FLYWHEEL_TLS_CERT`; null (and no `ca_file`): plaintext gRPC."""

    key_file: str | None = Field(default_factory=lambda: _env("FLYWHEEL_TLS_KEY"))
    """PEM private key of `cert_file` (`tls.key`); defaults to `$FLYWHEEL_TLS_KEY`."""

    ca_file: str | None = Field(default_factory=lambda: _env("FLYWHEEL_TLS_CA"))
    """PEM bundle of the CA that signs the services' certificates (`ca.crt`): clients check
    servers against it, and servers check clients with `require_client_cert`. Defaults to
    `$FLYWHEEL_TLS_CA`; null: clients use the system's roots."""

    require_client_cert: bool = Field(
        default_factory=lambda: os.environ.get("FLYWHEEL_TLS_REQUIRE_CLIENT_CERT", "") == "1"
    )
    """mTLS: servers refuse clients without a certificate signed by `ca_file`; defaults to
    `$FLYWHEEL_TLS_REQUIRE_CLIENT_CERT=1`."""

    server_name: str | None = Field(default_factory=lambda: _env("FLYWHEEL_TLS_SERVER_NAME"))
    """Name clients expect in the servers' certificates instead of the dialled host (one
    certificate for every service, or services dialled by IP); defaults to
    `$FLYWHEEL_TLS_SERVER_NAME`; null: the host of the address."""

    @property
    def enabled(self) -> bool:
        """True when servers serve TLS (cert_file and key_file set)."""
        return bool(self.cert_file and self.key_file)

    @property
    def client_enabled(self) -> bool:
        """True when clients dial with TLS: a certificate of their own, or only `ca_file`
        (a process that calls services but serves none, such as `flywheel status`)."""
        return self.enabled or bool(self.ca_file)

    @model_validator(mode="after")
    def _complete(self) -> TLSConfig:
        if bool(self.cert_file) != bool(self.key_file):
            raise RuleViolation(
                "key_file" if self.cert_file else "cert_file",
                None,
                "TLS needs both cert_file and key_file (tls.crt and tls.key)",
            )
        if self.require_client_cert and not (self.enabled and self.ca_file):
            raise RuleViolation(
                "require_client_cert",
                True,
                "mTLS needs cert_file, key_file and ca_file (the CA that signs the clients)",
            )
        return self


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

    auth_token: str | None = Field(default_factory=_token_from_env, json_schema_extra=SECRET)
    """Bearer token this process sends on every RPC; defaults to `$FLYWHEEL_TOKEN`. Without
    `credentials` it is also the one shared token servers accept, for every method; null
    (and no `credentials`) disables auth."""

    credentials: dict[str, str] = Field(
        default_factory=credentials_from_env, json_schema_extra=SECRET
    )
    """Per-caller tokens servers accept, `role: token` (roles: admin, trainer, rollout,
    launcher), each allowed only its role's methods (rollout may put, only the trainer may
    set versions or stream weights; see docs/security.md). A token may be written as
    `sha256:<hex digest>` so servers hold no usable token. Defaults to
    `$FLYWHEEL_CREDENTIALS` (`role=token,role=token`); empty: `auth_token` alone, for all."""

    tls: TLSConfig = Field(default_factory=TLSConfig)
    """TLS (and optionally mTLS) of every gRPC server and client."""

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

    @model_validator(mode="after")
    def _known_roles(self) -> ServicesConfig:
        unknown = sorted(set(self.credentials) - set(ROLES))
        if unknown:
            raise RuleViolation(
                "credentials", unknown, f"unknown roles; the roles are {', '.join(ROLES)}"
            )
        empty = sorted(role for role, token in self.credentials.items() if not token)
        if empty:
            raise RuleViolation("credentials", empty, "every role needs a non-empty token")
        return self
