"""One way to build a Flywheel gRPC server: health, reflection, auth, size limits, drain.

Every service needs the same things around its servicer: `grpc.health.v1` so probes and
the launcher can gate on readiness, reflection so `grpcurl` works, message limits raised
above gRPC's 4 MB default (real trajectory groups are larger), bearer tokens (one shared
token, or one per caller with the methods that caller may use), TLS or mTLS from PEM files,
and a SIGTERM path that turns health NOT_SERVING before draining so load balancers stop
sending work first.

Every refused credential is counted on the service's own registry (`AuthFailureMetrics`,
held by each service's metrics object and handed to its `ServiceServer`):

| metric | type | a bad trend means |
| --- | --- | --- |
| `flywheel_<service>_auth_failures_total{method,code}` | counter | any `UNAUTHENTICATED`: a caller without the run's token (a misconfigured process, or someone probing the port); any `PERMISSION_DENIED`: a token used beyond its role |
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter

from services.common.config.services import TLSConfig, credentials_from_env
from services.common.metrics import metric_name

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
_UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")

_BUFFER, _ROLLOUT = "flywheel.v1.BufferService", "flywheel.v1.RolloutService"
_REWARD, _TRAINER = "flywheel.v1.RewardService", "flywheel.v1.TrainerService"
_READ_BUFFER = tuple(
    f"{_BUFFER}/{m}" for m in ("GetVersion", "GetCapacity", "Stats", "ListGroups", "ReadGroup")
)
_SCORE = tuple(f"{_REWARD}/{m}" for m in ("Score", "ScoreBatch", "ListFunctions"))
ROLE_METHODS: dict[str, tuple[str, ...]] = {
    "admin": ("*",),
    "trainer": (
        *_READ_BUFFER,
        *(f"{_BUFFER}/{m}" for m in ("Claim", "Ack", "SetVersion", "Export")),
        *(
            f"{_ROLLOUT}/{m}"
            for m in ("UpdateWeights", "StreamWeights", "InitWeightsGroup", "Pause", "Resume")
        ),
        f"{_ROLLOUT}/GetVersion",
        f"{_ROLLOUT}/Stats",
        # the weight-sync parity probe: after each update the trainer has every replica
        # decode a fixed probe and scores the same tokens itself (services/trainer/parity.py)
        f"{_ROLLOUT}/Generate",
        *_SCORE,  # a reward computed on the trainer side (teacher, evaluation)
    ),
    "rollout": (
        *_READ_BUFFER,
        *(f"{_BUFFER}/{m}" for m in ("Put", "PutMany", "ReserveCapacity", "ReleaseCapacity")),
        *_SCORE,
    ),
    "launcher": (
        *_READ_BUFFER,
        f"{_BUFFER}/Export",
        *(f"{_ROLLOUT}/{m}" for m in ("Generate", "GetVersion", "Stats", "Pause", "Resume")),
        *_SCORE,
        f"{_TRAINER}/*",
    ),
}
"""What each caller named in `services.credentials` may call (`Service/Method`, or
`Service/*`): rollout puts and scores, only the trainer claims, acks, sets versions and
sends weights (and generates its parity probe on the replicas), the launcher (`flywheel run`, evaluation, status) reads, generates for
evaluation and controls the trainer; admin may call everything. The shared
`services.auth_token`, when no per-caller credentials are set, may call everything."""


def _digest(token: str) -> bytes:
    """sha256 of `token`; a token written as `sha256:<hex>` is its digest already."""
    if token.startswith("sha256:"):
        return bytes.fromhex(token.removeprefix("sha256:"))
    return hashlib.sha256(token.encode()).digest()


def _allows(patterns: Sequence[str], method: str) -> bool:
    name = method.lstrip("/")
    service = name.split("/", 1)[0]
    return any(p == "*" or p == name or p == f"{service}/*" for p in patterns)


def message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel/server options: both message limits raised together, plus larger read chunks,
    write buffers and HTTP/2 frames. Trajectory groups are hundreds of KB; with gRPC's small
    defaults a loopback call of 173 KB spends a quarter more CPU in framing and reads."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
        ("grpc.experimental.tcp_read_chunk_size", 1 << 20),
        ("grpc.http2.write_buffer_size", 1 << 20),
        ("grpc.http2.max_frame_size", 1 << 20),
    ]


class AuthFailureMetrics:
    """`flywheel_<service>_auth_failures_total{method,code}`: calls refused for their
    credential. `method` is the called `Service/Method` when the server has it, else
    `unknown` (a caller cannot grow the label set with made-up names); `code` is
    `UNAUTHENTICATED` (no token, or not one the server accepts) or `PERMISSION_DENIED`
    (a token used beyond its role)."""

    def __init__(self, service: str, registry: CollectorRegistry) -> None:
        self.failures = Counter(
            metric_name(service, "auth_failures", "total"),
            "Calls refused for their credential (UNAUTHENTICATED or PERMISSION_DENIED).",
            ["method", "code"],
            registry=registry,
        )

    def count(self, method: str, code: grpc.StatusCode) -> None:
        self.failures.labels(method, code.name).inc()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` (UNAUTHENTICATED), and calls
    of methods the token's role may not use (PERMISSION_DENIED); health and reflection stay
    open so that Kubernetes probes (which cannot send headers) keep working.

    `token` alone: the one shared token, allowed everything. `credentials` (`role: token`):
    each token allowed its role's methods (`ROLE_METHODS`), and `token` is not accepted.
    Tokens are compared as sha256 digests with `hmac.compare_digest`. Each refusal is
    counted in `metrics` when given."""

    def __init__(
        self,
        token: str | None = None,
        credentials: Mapping[str, str] | None = None,
        metrics: AuthFailureMetrics | None = None,
    ):
        self.metrics = metrics
        if credentials:
            self._table = [
                (_digest(t), role, ROLE_METHODS[role]) for role, t in credentials.items()
            ]
        elif token:
            self._table = [(_digest(token), "shared", ("*",))]
        else:
            raise ValueError("BearerTokenInterceptor needs a token or credentials")

        async def _deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(_deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(_deny)

    def _role(self, value: str | bytes) -> tuple[str, Sequence[str]] | None:
        raw = value if isinstance(value, bytes) else value.encode()
        if not raw.startswith(b"Bearer "):
            return None
        digest = hashlib.sha256(raw.removeprefix(b"Bearer ")).digest()
        found = None
        for expected, role, methods in self._table:  # no early exit: constant time per table
            if hmac.compare_digest(digest, expected):
                found = (role, methods)
        return found

    @staticmethod
    def _forbidden(role: str, method: str, streaming: bool) -> grpc.RpcMethodHandler:
        async def _deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the {role} credential may not call {method} (see services.credentials)",
            )

        if streaming:
            return grpc.stream_unary_rpc_method_handler(_deny)
        return grpc.unary_unary_rpc_method_handler(_deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if method.startswith(_UNAUTHENTICATED_PREFIXES):
            return await continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                found = self._role(value)
                if found is None:
                    continue
                role, methods = found
                if _allows(methods, method):
                    return await continuation(handler_call_details)
                handler = await continuation(handler_call_details)
                self._count(method, handler, grpc.StatusCode.PERMISSION_DENIED)
                return self._forbidden(
                    role, method, handler is not None and handler.request_streaming
                )
        handler = await continuation(handler_call_details)
        self._count(method, handler, grpc.StatusCode.UNAUTHENTICATED)
        if handler is not None and handler.request_streaming:
            return self._deny_stream
        return self._deny_unary

    def _count(
        self, method: str, handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode
    ) -> None:
        if self.metrics is not None:
            self.metrics.count(method.lstrip("/") if handler is not None else "unknown", code)


def read_pem(path: str | None) -> bytes | None:
    """The bytes of a PEM file, None for no path."""
    return Path(path).read_bytes() if path else None


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """TLS credentials of a server from `tls`'s PEM files; with `require_client_cert`,
    clients must present a certificate signed by `tls.ca_file` (mTLS)."""
    key, cert = read_pem(tls.key_file), read_pem(tls.cert_file)
    assert key is not None and cert is not None, "TLS needs cert_file and key_file"
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=read_pem(tls.ca_file),
        require_client_auth=tls.require_client_cert,
    )


def tls_from_env() -> TLSConfig:
    """The process's TLS settings from `FLYWHEEL_TLS_*` (see `services.tls`)."""
    return TLSConfig()


class ServiceServer:
    """An aio gRPC server with the behaviour every Flywheel service shares."""

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        auth_token: str | None = None,
        service_names: Sequence[str] = (),
        credentials: Mapping[str, str] | None = None,
        tls: TLSConfig | None = None,
        auth_metrics: AuthFailureMetrics | None = None,
    ) -> None:
        """`credentials` and `tls` default to the environment (`FLYWHEEL_CREDENTIALS`,
        `FLYWHEEL_TLS_*`), the same defaults as `services.credentials` and `services.tls`.
        The server's TLS settings are its own: each client is handed its `tls` by whoever
        builds it.
        `auth_metrics`: where refused credentials are counted (the service's registry)."""
        self.name = name
        self.host = host
        self.port = port
        self.service_names = list(service_names)
        if credentials is None:
            credentials = credentials_from_env()
        self.tls = tls if tls is not None else tls_from_env()
        interceptors = (
            [BearerTokenInterceptor(auth_token, credentials, auth_metrics)]
            if (auth_token or credentials)
            else []
        )
        # No SO_REUSEPORT (gRPC sets it by default): a second server started on a taken port
        # would otherwise bind too and silently take half of the new connections.
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[*message_size_options(max_message_bytes), ("grpc.so_reuseport", 0)],
        )
        aio = getattr(health, "aio", None)  # grpcio-health-checking may lack the aio servicer
        self._health = aio.HealthServicer() if aio is not None else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, HEALTH_SERVICE, reflection.SERVICE_NAME], self.server
        )
        self._stopped = asyncio.Event()
        self._stopping = False

    async def start(self) -> int:
        """Bind, start and report SERVING; returns the bound port (useful with port=0)."""
        address = f"{self.host}:{self.port}"
        if self.tls.enabled:
            self.port = self.server.add_secure_port(address, server_credentials(self.tls))
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"{self.name}: could not bind {self.host}")
        await self.server.start()
        self.set_serving(True)
        log.info(
            "grpc server started",
            extra={
                "address": f"{self.host}:{self.port}",
                "tls": "mtls" if self.tls.require_client_cert else self.tls.enabled,
            },
        )
        return self.port

    def set_serving(self, serving: bool) -> None:
        """Set grpc.health.v1 status for the overall server ("") and every named service."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for svc in ["", *self.service_names]:
            result = self._health.set(svc, status)
            if asyncio.iscoroutine(result):
                asyncio.ensure_future(result)

    async def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING first (so probes and balancers drain us), then finish in-flight calls."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        self.set_serving(False)
        await asyncio.sleep(0)
        await self.server.stop(grace)
        self._stopped.set()
        log.info("grpc server stopped")

    def install_signal_handlers(self, grace: float = 5.0) -> None:
        """SIGTERM/SIGINT start a graceful stop; must be called from the running loop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.stop(grace)))

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()
