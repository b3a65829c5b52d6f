"""PutMany over real gRPC and a real redis-server: several groups in one call and one Redis
round trip, each admitted exactly as its own Put would be, answered in order."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from flywheel_proto.v1 import buffer_pb2, buffer_pb2_grpc
from services.buffer.servicer import MAX_PUTS_PER_CALL
from services.common.codec import group_to_proto

from .helpers import assert_groups_equal, make_group

pytestmark = pytest.mark.integration


def put_request(group, rid: str = "") -> buffer_pb2.PutRequest:  # noqa: ANN001
    return buffer_pb2.PutRequest(request_id=rid or group.group_id, group=group_to_proto(group))


async def test_each_group_gets_its_own_verdict_in_order(make_buffer) -> None:
    _, client = await make_buffer(rollout={"max_head_offpolicyness": 1})
    assert await client.set_version(3) == 3
    await client.put(make_group("old", version=3))
    bad = group_to_proto(make_group("bad", version=3))
    bad.trajectories[0].logprobs.data = b"\x00" * 3
    groups = [
        make_group("a", version=3),
        make_group("old", version=3),  # already stored
        make_group("s", version=3, oldest=1),  # 1 < 3 - 1
        bad,
        make_group("b", version=2),
    ]
    results = await client.put_many(groups)
    assert [r.result for r in results] == ["admitted", "duplicate", "stale", "invalid", "admitted"]
    assert "logprobs: byte length 3" in results[3].reason
    assert "oldest token version 1 < version 3" in results[2].reason
    assert all(r.version == 3 for i, r in enumerate(results) if i != 3)
    s = await client.stats()
    # old + a, s, bad, b: 5 puts; the duplicate is not a put
    assert (s.put_total, s.pending, s.duplicate_total) == (5, 3, 1)
    assert (s.dropped_total["stale_at_put"], s.dropped_total["invalid"]) == (1, 1)
    assert s.invariant_ok
    out = await client.claim(3, consumer_id="t")
    assert sorted(out.group_ids) == ["a", "b", "old"]
    assert out.group_ids[0] == "b"  # oldest version first
    for got in out.groups:
        want = {"a": groups[0], "b": groups[4], "old": groups[1]}[got.group_id]
        assert_groups_equal(want, got)


def renamed(group, prefix: str):  # noqa: ANN001, ANN201
    msg = group_to_proto(group)
    msg.group_id = prefix + msg.group_id
    for t in msg.trajectories:
        t.group_id = msg.group_id
    return msg


async def test_stores_the_same_as_single_puts(make_buffer) -> None:
    _, client = await make_buffer()
    groups = [make_group(f"{i}", version=i % 3, rewards=(0.0, 1.0, 0.5)) for i in range(12)]
    for g in groups:
        assert (await client.put(renamed(g, "one-"))).result == "admitted"
    singles = await client.claim(12, consumer_id="t")
    await client.ack(singles.group_ids)
    results = await client.put_many([renamed(g, "many-") for g in groups])
    assert [r.result for r in results] == ["admitted"] * 12
    batched = await client.claim(12, consumer_id="t")
    assert [g.removeprefix("one-") for g in singles.group_ids] == [
        g.removeprefix("many-") for g in batched.group_ids
    ]
    for a, b in zip(singles.messages, batched.messages, strict=True):
        b.group_id = a.group_id
        for t in b.trajectories:
            t.group_id = a.group_id
        assert a.SerializeToString() == b.SerializeToString()
    s = await client.stats()
    assert (s.put_total, s.acked_total, s.in_flight) == (24, 12, 12) and s.invariant_ok


async def test_full_buffer_answers_full_per_group_and_the_client_waits(make_buffer) -> None:
    _, client = await make_buffer(buffer={"max_stored_groups": 2, "retry_after_ms": 30})
    stub = buffer_pb2_grpc.BufferServiceStub(client.channel)
    groups = [make_group(f"g{i}") for i in range(4)]
    resp = await stub.PutMany(buffer_pb2.PutManyRequest(puts=[put_request(g) for g in groups]))
    assert [r.result for r in resp.results] == [
        buffer_pb2.ADMISSION_RESULT_ADMITTED,
        buffer_pb2.ADMISSION_RESULT_ADMITTED,
        buffer_pb2.ADMISSION_RESULT_FULL,
        buffer_pb2.ADMISSION_RESULT_FULL,
    ]
    assert resp.results[2].retry_after_ms == 30 and "max_stored_groups" in resp.results[2].reason
    assert (await client.stats()).put_total == 2  # refused, not decided

    async def trainer() -> None:
        for _ in range(2):
            # Returns as soon as both arrived; the wait only has to outlast a loaded machine.
            out = await client.claim(2, consumer_id="t", wait_ms=60_000)
            await client.ack(out.group_ids)

    # The client sends only the refused ones again; the first two come back as duplicates.
    put_task = asyncio.create_task(client.put_many(groups))
    await trainer()
    assert [r.result for r in await put_task] == ["duplicate", "duplicate", "admitted", "admitted"]
    s = await client.stats()
    assert (s.put_total, s.acked_total, s.pending, s.duplicate_total) == (4, 4, 0, 2)
    assert s.invariant_ok


@pytest.mark.parametrize(
    ("puts", "needle"),
    [
        (lambda: [], "puts: must hold 1 to"),
        (
            lambda: [put_request(make_group("x"), "1"), put_request(make_group("x"), "2")],
            "distinct",
        ),
        (lambda: [put_request(make_group("x"))] * (MAX_PUTS_PER_CALL + 1), "puts: must hold"),
    ],
)
async def test_malformed_calls_get_invalid_argument_and_store_nothing(
    make_buffer, puts, needle
) -> None:
    _, client = await make_buffer()
    stub = buffer_pb2_grpc.BufferServiceStub(client.channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PutMany(buffer_pb2.PutManyRequest(puts=puts()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    s = await client.stats()
    assert (s.put_total, s.stored_groups) == (0, 0) and s.invariant_ok


async def test_a_failing_user_filter_fails_the_call_and_stores_nothing(make_buffer) -> None:
    from . import helpers

    _, client = await make_buffer(buffer={"filter": f"{helpers.__name__}:exploding_filter"})
    stub = buffer_pb2_grpc.BufferServiceStub(client.channel)
    req = buffer_pb2.PutManyRequest(puts=[put_request(make_group(f"g{i}")) for i in range(3)])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PutMany(req)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    s = await client.stats()
    assert (s.put_total, s.stored_groups) == (0, 0) and s.invariant_ok


@pytest.mark.parametrize("method", ["Put", "PutMany"])
async def test_undecodable_bytes_get_invalid_argument(make_buffer, method: str) -> None:
    _, client = await make_buffer()
    call = client.channel.unary_unary(f"/flywheel.v1.BufferService/{method}")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(b"\x0a\xff\xff\xff\x0f")  # a length far past the end
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid flywheel.v1." in err.value.details()
    s = await client.stats()
    assert (s.put_total, s.stored_groups) == (0, 0) and s.invariant_ok


async def test_a_group_sent_in_two_parts_is_stored_as_protobuf_merges_it(make_buffer) -> None:
    """The buffer stores the bytes it received; when they are not one slice (the group
    field given twice, which protobuf merges), it stores the merged group instead."""
    _, client = await make_buffer()
    whole = group_to_proto(make_group("m"))
    head = buffer_pb2.PutRequest(request_id="r", group=whole).SerializeToString()
    tail = buffer_pb2.PutRequest(group={"prompt_id": "p7"}).SerializeToString()
    call = client.channel.unary_unary(
        "/flywheel.v1.BufferService/Put",
        response_deserializer=buffer_pb2.PutResponse.FromString,
    )
    resp = await call(head + tail)
    assert resp.result == buffer_pb2.ADMISSION_RESULT_ADMITTED
    out = await client.claim(1, consumer_id="c")
    assert out.messages[0].prompt_id == "p7"
    whole.prompt_id = "p7"
    assert out.messages[0] == whole
