"""Channels with raised limits and auth, and retries that ride through a peer's restart.

A retry is safe when the RPC is idempotent: reads, and writes that carry a `request_id`
(or another id, like a group id) the server deduplicates on. Non-idempotent calls are tried
once. Two kinds of failure are retried, with bounded exponential back-off:

- an outage (UNAVAILABLE, or DEADLINE_EXCEEDED: no server answered within the attempt's
  deadline) is retried for up to `outage_budget_s` seconds, counted from the start of the
  first failed attempt, so a call made while a peer restarts (a pod rescheduled, Redis behind
  the buffer restarted) succeeds once the peer is back, on a new process on the same address;
- the server's own "not now" (RESOURCE_EXHAUSTED with a `retry-after-ms` hint) is retried
  after the hint, within the same budget; RESOURCE_EXHAUSTED without one (a message above
  the size limit, which no repetition fixes) and ABORTED at most `NOT_NOW_RETRIES` times.

`retries`, when set, also caps the number of retries (0: none). INVALID_ARGUMENT and the
like are returned at once, because repeating them cannot succeed. Every attempt's outcome
goes to the peer's `PeerHealth` (services/common/outage.py), which exports the outage.
Channels reconnect within `_MAX_RECONNECT_BACKOFF_MS` of the peer's return (gRPC's default
back-off grows to two minutes) and re-resolve DNS as often, for a pod that came back on a
new IP.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from services.common.config.services import TLSConfig
from services.common.grpc_server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    message_size_options,
    read_pem,
    tls_from_env,
)
from services.common.outage import PeerHealth

T = TypeVar("T")

OUTAGE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Statuses that mean no server answered: the peer is down, restarting or unreachable."""

RETRYABLE = OUTAGE | {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}

DEFAULT_OUTAGE_BUDGET_S = 300.0
"""How long a call to a peer the service cannot run without (buffer, reward) keeps trying:
longer than a Redis or pod restart takes on any cluster (see `services.peer_outage_budget_s`)."""

NOT_NOW_RETRIES = 3
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
_MAX_RECONNECT_BACKOFF_MS = 2000
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
    ("grpc.dns_min_time_between_resolutions_ms", _MAX_RECONNECT_BACKOFF_MS),
]


def _tls(tls: TLSConfig | None) -> TLSConfig:
    """The TLS settings a channel was handed, else `FLYWHEEL_TLS_*` from the environment
    (there is no process-wide default: whoever builds a client passes its `tls`)."""
    return tls if tls is not None else tls_from_env()


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    """Client TLS credentials: servers checked against `tls.ca_file` (system roots when
    unset); this process's certificate presented for mTLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls.ca_file),
        private_key=read_pem(tls.key_file),
        certificate_chain=read_pem(tls.cert_file),
    )


def _tls_options(tls: TLSConfig) -> list[tuple[str, Any]]:
    return [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []


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
    tls: TLSConfig | None = None,
) -> grpc.aio.Channel:
    """An aio channel whose limits match the servers' (both ends must raise them); TLS when
    `tls` (default: `FLYWHEEL_TLS_*` from the environment) is enabled."""
    interceptors = [_AuthInterceptor(auth_token)] if auth_token else None
    tls = _tls(tls)
    options = [*message_size_options(max_message_bytes), *_CHANNEL_OPTIONS, *_tls_options(tls)]
    if tls.client_enabled:
        return grpc.aio.secure_channel(
            address, channel_credentials(tls), options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def make_sync_channel(
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    auth_token: str | None = None,
    tls: TLSConfig | None = None,
) -> grpc.Channel:
    """A blocking channel with the same options, for scripts and torch ranks without a loop."""
    tls = _tls(tls)
    options = [*message_size_options(max_message_bytes), *_CHANNEL_OPTIONS, *_tls_options(tls)]
    if tls.client_enabled:
        channel = grpc.secure_channel(address, channel_credentials(tls), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if auth_token:
        channel = grpc.intercept_channel(channel, _SyncAuthInterceptor(auth_token))
    return channel


def backoff_s(attempt: int, base: float = BACKOFF_BASE_S, cap: float = BACKOFF_CAP_S) -> float:
    """Sleep before retry `attempt` (1, 2, ...): doubling from `base`, capped, with jitter
    (half to all of it) so that the clients of a restarted peer do not return in step."""
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


def status_code(err: BaseException) -> grpc.StatusCode | None:
    code = getattr(err, "code", None)
    return code() if callable(code) else None


class RetryClock:
    """The retry decisions of one logical call (shared by the async and blocking loops).

    `failed(err, started)` after an attempt that raised returns how long to sleep before
    the next attempt, or None when the error must be raised: not retryable, not idempotent,
    out of `retries`, or out of `outage_budget_s` since the first failed attempt began.
    """

    def __init__(
        self,
        idempotent: bool,
        outage_budget_s: float,
        retries: int | None,
        peer: PeerHealth | None,
        retry_codes: frozenset[grpc.StatusCode] = RETRYABLE,
    ) -> None:
        self.idempotent = idempotent
        self.retry_codes = retry_codes
        self.budget = outage_budget_s
        self.retries = retries
        self.peer = peer
        self.attempt = 0
        self._not_now = 0
        self._first_failure: float | None = None

    def answered(self) -> None:
        if self.peer is not None:
            self.peer.answered()

    def failed(self, err: grpc.RpcError, started: float) -> float | None:
        code = status_code(err)
        if self.peer is not None:
            if code in OUTAGE:
                self.peer.failed(since=started)
            else:
                self.peer.answered()
        if code not in self.retry_codes or not self.idempotent:
            return None
        if self.retries is not None and self.attempt >= self.retries:
            return None
        hint = _retry_after(err)
        if code not in OUTAGE and hint is None:
            if self._not_now >= NOT_NOW_RETRIES:
                return None
            self._not_now += 1
        if self._first_failure is None:
            self._first_failure = started
        left = self._first_failure + self.budget - time.monotonic()
        if left <= 0:
            return None
        self.attempt += 1
        # The last attempt is made at the end of the budget, not skipped for want of time.
        return min(left, hint or backoff_s(self.attempt))


async def call_with_retry(
    method: Callable[..., Awaitable[T]],
    request: Any,
    *,
    timeout: float,
    idempotent: bool,
    retries: int | None = None,
    outage_budget_s: float = DEFAULT_OUTAGE_BUDGET_S,
    peer: PeerHealth | None = None,
    retry_codes: frozenset[grpc.StatusCode] = RETRYABLE,
) -> T:
    """Call an aio stub method with a per-attempt deadline (`timeout`), retrying transient
    failures of idempotent calls (see the module docstring).

    Non-idempotent calls are tried once: a DEADLINE_EXCEEDED does not tell whether the
    server applied them, so repeating could apply them twice. `retry_codes` narrows what is
    retried (a caller that handles backpressure itself passes `OUTAGE`).
    """
    clock = RetryClock(idempotent, outage_budget_s, retries, peer, retry_codes)
    while True:
        started = time.monotonic()
        try:
            result = await method(request, timeout=timeout)
        except grpc.RpcError as err:
            delay = clock.failed(err, started)
            if delay is None:
                raise
            await asyncio.sleep(delay)
            continue
        clock.answered()
        return result


def call_with_retry_sync(
    method: Callable[..., T],
    request: Any,
    *,
    timeout: float,
    idempotent: bool,
    retries: int | None = None,
    outage_budget_s: float = DEFAULT_OUTAGE_BUDGET_S,
    peer: PeerHealth | None = None,
    retry_codes: frozenset[grpc.StatusCode] = RETRYABLE,
) -> T:
    """Blocking twin of `call_with_retry`."""
    clock = RetryClock(idempotent, outage_budget_s, retries, peer, retry_codes)
    while True:
        started = time.monotonic()
        try:
            result = method(request, timeout=timeout)
        except grpc.RpcError as err:
            delay = clock.failed(err, started)
            if delay is None:
                raise
            time.sleep(delay)
            continue
        clock.answered()
        return result


class RetryingClient:
    """What the typed clients share: the retry settings of their calls, read at each call
    (a test may set `retries = 0` on a live client), and the peer's `PeerHealth`."""

    address: str
    timeout: float
    retries: int | None
    outage_budget_s: float
    peer: PeerHealth

    def _retry_settings(
        self,
        peer_name: str,
        address: str,
        timeout: float,
        retries: int | None,
        outage_budget_s: float,
        peer: PeerHealth | None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self.outage_budget_s = outage_budget_s
        self.peer = peer if peer is not None else PeerHealth(peer_name, address)

    async def _retrying(
        self,
        method: Callable[..., Awaitable[T]],
        request: Any,
        *,
        idempotent: bool = True,
        timeout: float | None = None,
        retry_codes: frozenset[grpc.StatusCode] = RETRYABLE,
    ) -> T:
        return await call_with_retry(
            method,
            request,
            timeout=timeout if timeout is not None else self.timeout,
            idempotent=idempotent,
            retries=self._retries_now(),
            outage_budget_s=self.outage_budget_s,
            peer=self.peer,
            retry_codes=retry_codes,
        )

    def _retries_now(self) -> int | None:
        return self.retries


async def wait_for_health(
    address: str, *, timeout: float = 30.0, service: str = "", tls: TLSConfig | None = None
) -> None:
    """Block until the server at `address` reports SERVING (used to gate start-up order)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    async with make_channel(address, tls=tls) as channel:
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
