"""Calls that ride through a peer's restart (services/common/grpc_client.py) and the outage
they report (services/common/outage.py).

The peer is a real aio gRPC server on loopback (the shared `ServiceServer`; its health
service is the idempotent RPC under test). It is stopped, a call is made while nothing
listens, and a new server is started on the same port: the call must succeed on it. The
outages last a few seconds, longer than the old fixed retry count (3 retries, 0.05-0.4 s
apart: under a second) and than gRPC's default reconnect back-off reaches by then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from services.common.grpc_client import (
    NOT_NOW_RETRIES,
    call_with_retry,
    call_with_retry_sync,
    make_channel,
    make_sync_channel,
)
from services.common.grpc_server import ServiceServer
from services.common.outage import PeerHealth, PeerOutageMetrics
from services.common.redis_server import free_port
from tests.waiting import still_pending, until

SERVING = health_pb2.HealthCheckResponse.SERVING
CHECK = health_pb2.HealthCheckRequest(service="")
OUTAGE_S = 4.0  # how long nothing listens: longer than the old retry window


async def _serve(port: int) -> ServiceServer:
    srv = ServiceServer("peer", port=port)
    await srv.start()
    return srv


def _metrics() -> tuple[CollectorRegistry, PeerOutageMetrics]:
    registry = CollectorRegistry()
    return registry, PeerOutageMetrics("test", registry)


def _sample(registry: CollectorRegistry, name: str, peer: str) -> float | None:
    return registry.get_sample_value(name, {"peer": peer})


async def _until(cond: Callable[[], bool]) -> None:
    await until(cond, "the client to see the peer down")


@pytest.mark.integration
@pytest.mark.slow
async def test_a_call_made_while_the_peer_is_down_succeeds_on_its_successor() -> None:
    first = await _serve(0)
    address = f"127.0.0.1:{first.port}"
    registry, metrics = _metrics()
    peer = metrics.peer("echo", address)
    channel = make_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        resp = await call_with_retry(stub.Check, CHECK, timeout=30, idempotent=True, peer=peer)
        assert resp.status == SERVING and not peer.down  # connected once
        await first.stop(0)
        call = asyncio.create_task(
            call_with_retry(stub.Check, CHECK, timeout=30, idempotent=True, peer=peer)
        )
        await _until(lambda: peer.down)
        assert _sample(registry, "flywheel_test_peer_unavailable", "echo") == 1.0
        await still_pending(call, hold_s=OUTAGE_S)  # still trying (the budget is minutes)
        second = await _serve(first.port)  # a new server on the same address
        try:
            assert (await call).status == SERVING
        finally:
            await second.stop(0)
    finally:
        await channel.close()
    counted = _sample(registry, "flywheel_test_peer_unavailable_seconds_total", "echo")
    assert counted is not None and counted > 0
    assert counted == pytest.approx(peer.unavailable_seconds, rel=0, abs=1e-9)
    assert _sample(registry, "flywheel_test_peer_unavailable", "echo") == 0.0
    assert peer.outages == 1 and not peer.down


@pytest.mark.integration
@pytest.mark.slow
async def test_the_blocking_twin_rides_through_a_restart_too() -> None:
    first = await _serve(0)
    address = f"127.0.0.1:{first.port}"
    peer = PeerHealth("echo", address)
    channel = make_sync_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        await asyncio.to_thread(
            call_with_retry_sync, stub.Check, CHECK, timeout=30, idempotent=True
        )
        await first.stop(0)
        call = asyncio.ensure_future(
            asyncio.to_thread(
                call_with_retry_sync, stub.Check, CHECK, timeout=30, idempotent=True, peer=peer
            )
        )
        await _until(lambda: peer.down)
        await still_pending(call, hold_s=OUTAGE_S)
        second = await _serve(first.port)
        try:
            assert (await call).status == SERVING
        finally:
            await second.stop(0)
    finally:
        channel.close()
    assert peer.outages == 1 and not peer.down and peer.unavailable_seconds > 0


@pytest.mark.integration
async def test_an_outage_longer_than_the_budget_fails_and_leaves_the_peer_marked_down() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens here
    registry, metrics = _metrics()
    peer = metrics.peer("gone", address)
    attempts = 0
    channel = make_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)

    async def check(request: Any, timeout: float) -> Any:
        nonlocal attempts
        attempts += 1
        return await stub.Check(request, timeout=timeout)

    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            # A budget that outlasts a first attempt slowed by a loaded machine (with 0.5 s,
            # one slow connect used it all: one attempt); refused connects fail at once.
            await call_with_retry(
                check, CHECK, timeout=30, idempotent=True, outage_budget_s=3.0, peer=peer
            )
    finally:
        await channel.close()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert attempts >= 2  # retried within the budget, then gave up
    assert peer.down and _sample(registry, "flywheel_test_peer_unavailable", "gone") == 1.0
    assert (_sample(registry, "flywheel_test_peer_unavailable_seconds_total", "gone") or 0) > 0


def _failing(
    codes: list[grpc.StatusCode], trailers: tuple[tuple[str, str], ...] = ()
) -> tuple[Callable[..., Any], list[int]]:
    """A stub method that fails with `codes` in turn, then answers "ok"; counts attempts."""
    calls = [0]

    async def method(request: Any, timeout: float) -> str:
        calls[0] += 1
        if calls[0] <= len(codes):
            raise grpc.aio.AioRpcError(
                codes[calls[0] - 1], grpc.aio.Metadata(), grpc.aio.Metadata(*trailers)
            )
        return "ok"

    return method, calls


async def test_what_is_retried_and_what_is_not() -> None:
    unavailable = grpc.StatusCode.UNAVAILABLE
    # An outage of an idempotent call: retried until it answers.
    method, calls = _failing([unavailable] * 4)
    assert await call_with_retry(method, None, timeout=1, idempotent=True) == "ok"
    assert calls == [5]
    # Not idempotent: once, whatever the budget.
    method, calls = _failing([unavailable])
    with pytest.raises(grpc.aio.AioRpcError):
        await call_with_retry(method, None, timeout=1, idempotent=False)
    assert calls == [1]
    # `retries=0` turns retries off.
    method, calls = _failing([unavailable])
    with pytest.raises(grpc.aio.AioRpcError):
        await call_with_retry(method, None, timeout=1, idempotent=True, retries=0)
    assert calls == [1]
    # RESOURCE_EXHAUSTED without a retry-after hint (a message over the size limit): a few
    # tries, not the minutes of the outage budget.
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    method, calls = _failing([exhausted] * 99)
    with pytest.raises(grpc.aio.AioRpcError):
        await call_with_retry(method, None, timeout=1, idempotent=True)
    assert calls == [1 + NOT_NOW_RETRIES]
    # ... with a hint (the server's backpressure): waited out within the budget.
    method, calls = _failing([exhausted] * 6, trailers=(("retry-after-ms", "1"),))
    assert await call_with_retry(method, None, timeout=1, idempotent=True) == "ok"
    assert calls == [7]


def test_an_outage_is_counted_once_per_peer_however_many_calls_wait_on_it() -> None:
    now = [10.0]
    registry, metrics = _metrics()
    counter = metrics.seconds.labels(peer="p")
    health = PeerHealth(
        "p", seconds=counter, down=metrics.down.labels(peer="p"), clock=lambda: now[0]
    )
    health.failed(since=10.0)  # call A's attempt started at 10 and failed at once
    now[0] = 12.0
    health.failed(since=11.0)  # call B, same outage: counts wall time, not per call
    now[0] = 15.0
    health.failed(since=14.0)
    now[0] = 16.0
    health.answered()  # outage 1: 16 - 10 = 6 s
    now[0] = 20.0
    health.failed(since=18.0)  # a deadline that expired: down since the attempt began
    # outage 2 so far: 20 - 18 = 2 s; total 6 + 2 = 8 s
    assert health.unavailable_seconds == pytest.approx(8.0, rel=0, abs=1e-9)
    assert _sample(registry, "flywheel_test_peer_unavailable_seconds_total", "p") == pytest.approx(
        8.0, rel=0, abs=1e-9
    )
    assert health.outages == 2 and health.down
    assert _sample(registry, "flywheel_test_peer_unavailable", "p") == 1.0
