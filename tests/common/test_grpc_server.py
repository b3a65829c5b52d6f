"""A real aio gRPC server on loopback: health, drain, token auth, message-size limits.

The servicer here is a one-method echo registered with a generic handler: the shared
bootstrap is what is under test, and it must behave the same for every service.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_client import call_with_retry, make_channel, wait_for_health
from services.common.grpc_server import ServiceServer

ECHO = "/test.Echo/Echo"
MB = 1 << 20


def _identity(b: bytes) -> bytes:
    return b


def _echo_handler(started: asyncio.Event | None = None, release: asyncio.Event | None = None):
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if started is not None and release is not None:
            started.set()
            await release.wait()
        return request

    return grpc.method_handlers_generic_handler(
        "test.Echo",
        {"Echo": grpc.unary_unary_rpc_method_handler(echo, _identity, _identity)},
    )


async def _server(**kwargs) -> tuple[ServiceServer, str]:
    srv = ServiceServer("test", service_names=["test.Echo"], **kwargs)
    srv.server.add_generic_rpc_handlers([_echo_handler()])
    port = await srv.start()
    return srv, f"127.0.0.1:{port}"


def _echo(channel: grpc.aio.Channel):
    return channel.unary_unary(ECHO, request_serializer=_identity, response_deserializer=_identity)


async def _health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return resp.status


async def test_health_serving_then_not_serving_on_drain_and_inflight_call_finishes():
    started, release = asyncio.Event(), asyncio.Event()
    srv = ServiceServer("test", service_names=["test.Echo"])
    srv.server.add_generic_rpc_handlers([_echo_handler(started, release)])
    address = f"127.0.0.1:{await srv.start()}"
    await wait_for_health(address, timeout=5)
    assert await _health(address, "test.Echo") == health_pb2.HealthCheckResponse.SERVING
    async with make_channel(address) as ch:
        inflight = asyncio.ensure_future(_echo(ch)(b"in flight", timeout=10))
        await started.wait()
        stopping = asyncio.ensure_future(srv.stop(grace=10))
        await asyncio.sleep(0.2)
        # Draining: health says NOT_SERVING while the call in flight is still running.
        assert srv._health._server_status[""] == health_pb2.HealthCheckResponse.NOT_SERVING
        assert srv._health._server_status["test.Echo"] == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not inflight.done()
        release.set()
        assert await inflight == b"in flight"
        await stopping


async def test_a_second_server_on_a_taken_port_fails_instead_of_sharing_it():
    # gRPC binds with SO_REUSEPORT by default; then both would listen and split connections.
    first, address = await _server()
    second = ServiceServer("second")
    second.port = first.port
    try:
        with pytest.raises(RuntimeError, match="could not bind|Failed to bind"):
            await second.start()
        async with make_channel(address) as ch:  # the first still gets every call
            for _ in range(4):
                assert await _echo(ch)(b"x", timeout=5) == b"x"
    finally:
        await first.stop(grace=0)
        await second.server.stop(0)  # started only if the bind wrongly succeeded


async def test_set_serving_false_is_visible_over_the_wire():
    srv, address = await _server()
    try:
        srv.set_serving(False)
        await asyncio.sleep(0.05)
        assert await _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        srv.set_serving(True)
        await asyncio.sleep(0.05)
        assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await srv.stop(0)


async def test_token_auth_accepts_right_token_and_refuses_missing_or_wrong():
    srv, address = await _server(auth_token="s3cret")
    try:
        async with make_channel(address, auth_token="s3cret") as ch:
            assert await _echo(ch)(b"hi", timeout=5) == b"hi"
        for token in (None, "wrong"):
            async with make_channel(address, auth_token=token) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _echo(ch)(b"hi", timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays reachable without a token (Kubernetes probes send no headers).
        assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await srv.stop(0)


async def test_32mb_message_passes_where_configured_and_is_refused_where_not():
    payload = b"x" * (32 * MB)
    srv, address = await _server(max_message_bytes=64 * MB)
    try:
        async with make_channel(address, max_message_bytes=64 * MB) as ch:
            assert len(await _echo(ch)(payload, timeout=30)) == len(payload)
        # A channel left at a 4 MB limit refuses to send it.
        async with make_channel(address, max_message_bytes=4 * MB) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _echo(ch)(payload, timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await srv.stop(0)
    small, address = await _server(max_message_bytes=4 * MB)
    try:
        async with make_channel(address, max_message_bytes=64 * MB) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _echo(ch)(payload, timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await small.stop(0)


async def test_retry_only_repeats_idempotent_calls():
    calls = 0

    async def flaky(request, timeout):
        nonlocal calls
        calls += 1
        if calls < 3:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata()
            )
        return "ok"

    assert await call_with_retry(flaky, None, timeout=1, retries=3, idempotent=True) == "ok"
    assert calls == 3
    calls = 0
    with pytest.raises(grpc.aio.AioRpcError):
        await call_with_retry(flaky, None, timeout=1, retries=3, idempotent=False)
    assert calls == 1

    async def invalid(request, timeout):
        nonlocal calls
        calls += 1
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata()
        )

    calls = 0
    with pytest.raises(grpc.aio.AioRpcError):
        await call_with_retry(invalid, None, timeout=1, retries=3, idempotent=True)
    assert calls == 1  # a bad request cannot succeed by repetition
