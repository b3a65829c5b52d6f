"""One way to build a Flywheel gRPC server: health, reflection, auth, size limits, drain.

Every service needs the same things around its servicer: `grpc.health.v1` so probes and
the launcher can gate on readiness, reflection so `grpcurl` works, message limits raised
above gRPC's 4 MB default (real trajectory groups are larger), an optional bearer token,
and a SIGTERM path that turns health NOT_SERVING before draining so load balancers stop
sending work first.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
_UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


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


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>`; health and reflection stay open
    so that Kubernetes probes (which cannot send headers) keep working."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def _deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(_deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(_deny)

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
                raw = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(raw, self._expected):
                    return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.request_streaming:
            return self._deny_stream
        return self._deny_unary


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
    ) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.service_names = list(service_names)
        interceptors = [BearerTokenInterceptor(auth_token)] if auth_token else []
        # No SO_REUSEPORT (gRPC sets it by default): a second server started on a taken port
        # would otherwise bind too and silently take half of the new connections.
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[*message_size_options(max_message_bytes), ("grpc.so_reuseport", 0)],
        )
        self._health = health.aio.HealthServicer() if hasattr(health, "aio") else None
        if self._health is None:  # grpcio-health-checking without the aio servicer
            self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, HEALTH_SERVICE, reflection.SERVICE_NAME], self.server
        )
        self._stopped = asyncio.Event()
        self._stopping = False

    async def start(self) -> int:
        """Bind, start and report SERVING; returns the bound port (useful with port=0)."""
        self.port = self.server.add_insecure_port(f"{self.host}:{self.port}")
        if self.port == 0:
            raise RuntimeError(f"{self.name}: could not bind {self.host}")
        await self.server.start()
        self.set_serving(True)
        log.info("grpc server started", extra={"address": f"{self.host}:{self.port}"})
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
