"""How the buffer's handlers meet gRPC (services/buffer/rpc_handlers.py), on a real gRPC
server on loopback: each kind of failure comes back as the status gRPC's own client reads,
with the trailer and the counters the docs promise, and the service stays up.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import redis.exceptions as redis_errors
from prometheus_client import CollectorRegistry

from flywheel_proto.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
from services.buffer.admission import BoundsRefusal, RpcFailure
from services.buffer.metrics import BufferMetrics
from services.buffer.rpc_handlers import parse_request, register, rpc

pytestmark = pytest.mark.integration


class Failing(buffer_pb2_grpc.BufferServiceServicer):
    """A servicer whose handlers fail the ways a real one can."""

    def __init__(self) -> None:
        self.metrics = BufferMetrics(CollectorRegistry())
        self.redis_failures: list[BaseException] = []
        self.on_redis_error = self.redis_failures.append

    @rpc
    async def GetVersion(self, request: common_pb2.Empty, context: Any) -> common_pb2.Version:
        raise redis_errors.ConnectionError("connection refused")

    @rpc
    async def Ack(self, request: buffer_pb2.AckRequest, context: Any) -> buffer_pb2.AckResponse:
        if request.group_ids == ["bug"]:
            raise KeyError("a bug")
        raise BoundsRefusal("group_ids", "at most 2")

    @rpc
    async def ReserveCapacity(self, request: Any, context: Any) -> Any:
        raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_ms=250)

    @rpc
    async def Put(self, request: bytes, context: Any) -> buffer_pb2.PutResponse:
        put = parse_request(buffer_pb2.PutRequest, request)  # the raw bytes, parsed here
        return buffer_pb2.PutResponse(reason=f"got {put.group.group_id}")


@pytest.fixture
async def served() -> AsyncIterator[tuple[Failing, grpc.aio.Channel]]:
    servicer = Failing()
    server = grpc.aio.server()
    register(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, channel
    await channel.close()
    await server.stop(grace=None)


def count(servicer: Failing, name: str, labels: dict[str, str] | None = None) -> float:
    value = servicer.metrics.registry.get_sample_value(name, labels or {})
    return value or 0.0


async def test_each_failure_is_the_status_a_grpc_client_reads(
    served: tuple[Failing, grpc.aio.Channel],
) -> None:
    servicer, channel = served
    stub = buffer_pb2_grpc.BufferServiceStub(channel)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetVersion(common_pb2.Empty())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "redis unavailable: connection refused" in (err.value.details() or "")
    assert len(servicer.redis_failures) == 1  # the health monitor was told
    assert count(servicer, "flywheel_buffer_redis_errors_total") == 1

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Ack(buffer_pb2.AckRequest(group_ids=["a", "b", "c"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "group_ids: at most 2"
    refused = {"method": "Ack", "field": "group_ids"}
    assert count(servicer, "flywheel_buffer_refused_requests_total", refused) == 1

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ReserveCapacity(buffer_pb2.ReserveCapacityRequest(count=1))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(err.value.trailing_metadata() or ())
    assert trailers["retry-after-ms"] == "250"

    with pytest.raises(grpc.aio.AioRpcError) as err:  # a bug answers, it does not crash
        await stub.Ack(buffer_pb2.AckRequest(group_ids=["bug"]))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "KeyError" in (err.value.details() or "")

    for method, code in (
        ("GetVersion", "UNAVAILABLE"),
        ("Ack", "INVALID_ARGUMENT"),
        ("ReserveCapacity", "RESOURCE_EXHAUSTED"),
    ):
        labels = {"method": method, "code": code}
        assert count(servicer, "flywheel_buffer_rpc_errors_total", labels) == 1
    assert count(servicer, "flywheel_buffer_rpc_seconds_count", {"method": "Ack"}) == 2


async def test_put_reads_its_own_bytes_and_names_a_request_that_is_none(
    served: tuple[Failing, grpc.aio.Channel],
) -> None:
    _, channel = served
    put = channel.unary_unary(
        "/flywheel.v1.BufferService/Put",
        request_serializer=None,
        response_deserializer=buffer_pb2.PutResponse.FromString,
    )
    request = buffer_pb2.PutRequest(group=common_pb2.TrajectoryGroup(group_id="g7"))
    assert (await put(request.SerializeToString())).reason == "got g7"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await put(b"\xff\xff\xff")  # not a protobuf message
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid flywheel.v1.PutRequest" in (err.value.details() or "")
