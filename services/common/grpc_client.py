"""Channels with raised limits and auth, and retries that only repeat what is safe.

A retry is safe when the RPC is idempotent: reads, and writes that carry a `request_id`
the server deduplicates on. Only transient statuses are retried; INVALID_ARGUMENT and the
like are returned at once because repeating them cannot succeed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from services.common.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, message_size_options

T = TypeVar("T")

RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)


class _AuthInterceptor(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    """Adds the bearer token to every call on an insecure (loopback/cluster) channel."""

    def __init__(self, token: str) -> None:
        self._md = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._md)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )

    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_token(client_call_details), request)

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._with_token(client_call_details), request_iterator)


class _SyncAuthInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._md = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._md]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(
                details.method,
                details.timeout,
                metadata,
                details.credentials,
                getattr(details, "wait_for_ready", None),
                getattr(details, "compression", None),
            )
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(client_call_details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):  # type: ignore[no-untyped-def]
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def make_channel(
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    auth_token: str | None = None,
) -> grpc.aio.Channel:
    """An aio channel whose limits match the servers' (both ends must raise them)."""
    interceptors = [_AuthInterceptor(auth_token)] if auth_token else None
    return grpc.aio.insecure_channel(
        address, options=message_size_options(max_message_bytes), interceptors=interceptors
    )


def make_sync_channel(
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    auth_token: str | None = None,
) -> grpc.Channel:
    """A blocking channel with the same options, for scripts and torch ranks without a loop."""
    channel = grpc.insecure_channel(address, options=message_size_options(max_message_bytes))
    if auth_token:
        channel = grpc.intercept_channel(channel, _SyncAuthInterceptor(auth_token))
    return channel


def _backoff(attempt: int, base: float = 0.05, cap: float = 2.0) -> float:
    return min(cap, base * (2**attempt)) * (0.5 + random.random() / 2)


def _retry_after(err: grpc.RpcError) -> float | None:
    """Honour a server's `retry-after-ms` trailer (sent with RESOURCE_EXHAUSTED)."""
    try:
        trailers = err.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - some errors carry no call
        return None
    for key, value in trailers:
        if key == "retry-after-ms":
            try:
                return float(value) / 1000.0
            except ValueError:
                return None
    return None


async def call_with_retry(
    method: Callable[..., Awaitable[T]],
    request: Any,
    *,
    timeout: float,
    retries: int,
    idempotent: bool,
) -> T:
    """Call an aio stub method with a per-attempt deadline, retrying transient failures.

    Non-idempotent calls are tried once: a DEADLINE_EXCEEDED does not tell whether the
    server applied them, so repeating could apply them twice.
    """
    attempts = retries + 1 if idempotent else 1
    for attempt in range(attempts):
        try:
            return await method(request, timeout=timeout)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            if code not in RETRYABLE or attempt == attempts - 1:
                raise
            await asyncio.sleep(_retry_after(err) or _backoff(attempt))
    raise AssertionError("unreachable")


def call_with_retry_sync(
    method: Callable[..., T],
    request: Any,
    *,
    timeout: float,
    retries: int,
    idempotent: bool,
) -> T:
    """Blocking twin of `call_with_retry`."""
    attempts = retries + 1 if idempotent else 1
    for attempt in range(attempts):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else None
            if code not in RETRYABLE or attempt == attempts - 1:
                raise
            time.sleep(_retry_after(err) or _backoff(attempt))
    raise AssertionError("unreachable")


async def wait_for_health(address: str, *, timeout: float = 30.0, service: str = "") -> None:
    """Block until the server at `address` reports SERVING (used to gate start-up order)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s")
            await asyncio.sleep(0.1)
