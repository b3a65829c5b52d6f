"""BufferClient (services/buffer/client.py): retries, backpressure, idempotent retries."""

from __future__ import annotations

import asyncio

import pytest

from flywheel_proto.v1 import buffer_pb2, buffer_pb2_grpc
from services.buffer.client import BufferFullError

from .helpers import make_group

pytestmark = pytest.mark.integration


async def test_put_retries_through_a_redis_restart(make_buffer, redis_server) -> None:
    _, client = await make_buffer(buffer={"health_check_interval_s": 0.05})
    client.retries = 30
    redis_server.kill()
    put = asyncio.create_task(client.put(make_group("g")))
    await asyncio.sleep(0.2)  # the first attempts meet a dead Redis and are retried
    assert not put.done()
    redis_server.start()
    assert (await put).result == "admitted"
    s = await client.stats()
    assert (s.put_total, s.pending, s.duplicate_total) == (1, 1, 0)


async def test_backpressure_that_outlasts_the_wait_raises(make_buffer) -> None:
    _, client = await make_buffer(
        buffer={"max_stored_groups": 1, "retry_after_ms": 20},
        client_kw={"backpressure_wait_s": 0.1},
    )
    await client.put(make_group("a"))
    with pytest.raises(BufferFullError, match="still full after 0.1s: buffer full: 1 groups"):
        await client.put(make_group("b"))
    assert (await client.stats()).put_total == 1


async def test_a_retried_claim_gets_the_same_batch(make_buffer) -> None:
    _, client = await make_buffer()
    for gid in "abcd":
        await client.put(make_group(gid))
    stub = buffer_pb2_grpc.BufferServiceStub(client.channel)
    req = buffer_pb2.ClaimRequest(request_id="claim-7", consumer_id="t", n_groups=2)
    first = await stub.Claim(req)
    again = await stub.Claim(req)  # as if the first answer had been lost
    assert [g.group_id for g in first.groups] == [g.group_id for g in again.groups] == ["a", "b"]
    s = await client.stats()
    assert (s.in_flight, s.pending, s.claimed_total) == (2, 2, 2)
