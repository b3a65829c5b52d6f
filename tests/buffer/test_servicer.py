"""The buffer over real gRPC on loopback, backed by a real redis-server."""

from __future__ import annotations

import asyncio
import random
import re

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flywheel_proto.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
from services.buffer.client import InvalidGroupError, VersionRegressionError
from services.common.codec import group_to_proto
from tests.waiting import until

from .helpers import assert_groups_equal, fsync_every_write, make_group

pytestmark = pytest.mark.integration


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = await stub.Check(
            health_pb2.HealthCheckRequest(service="flywheel.v1.BufferService"), timeout=5
        )
        return resp.status


async def wait_health(address: str, status: int) -> None:
    """Wait for a health state (no timing is asserted; the deadline is a guard)."""

    async def reached() -> bool:
        return await health(address) == status

    await until(reached, f"health status {status} at {address}", timeout=300)


async def test_put_claim_ack_round_trip(make_buffer) -> None:
    _, client = await make_buffer()
    groups = [make_group(f"g{i}", version=0) for i in range(3)]
    for g in groups:
        r = await client.put(g)
        assert (r.result, r.stored, r.version) == ("admitted", True, 0)
    out = await client.claim(3, consumer_id="trainer-0")
    assert out.group_ids == ["g0", "g1", "g2"] and out.version == 0
    for sent, got in zip(groups, out.groups, strict=True):
        assert_groups_equal(sent, got)
    assert await client.ack(out.group_ids, consumer_id="trainer-0") == 3
    assert await client.ack(out.group_ids, consumer_id="trainer-0") == 0
    dup = await client.put(groups[0])
    assert dup.result == "duplicate" and "acked" in dup.reason
    s = await client.stats()
    assert (s.put_total, s.acked_total, s.duplicate_total, s.pending, s.in_flight) == (
        3,
        3,
        1,
        0,
        0,
    )
    assert s.invariant_ok and s.claimed_total == 3 and not s.replay


async def test_malformed_groups_get_invalid_argument_and_are_counted_once(make_buffer) -> None:
    _, client = await make_buffer()
    bad = group_to_proto(make_group("bad"))
    bad.trajectories[0].logprobs.data = b"\x00" * 3  # not a whole float32
    with pytest.raises(InvalidGroupError, match="logprobs: byte length 3"):
        await client.put(bad)
    with pytest.raises(InvalidGroupError):  # a retry is refused again, not counted again
        await client.put(bad)
    no_gen = make_group("nogen")
    for t in no_gen.trajectories:
        t.loss_mask[:] = 0
        t.versions[:] = -1
    with pytest.raises(InvalidGroupError, match="no generated tokens"):
        await client.put(no_gen)
    stub = buffer_pb2_grpc.BufferServiceStub(client.channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Put(buffer_pb2.PutRequest(request_id="x", group=common_pb2.TrajectoryGroup()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "group_id is empty" in err.value.details()
    s = await client.stats()
    # bad, nogen, and the empty group (recognised by its request_id): 3 puts, 3 invalid
    assert (s.put_total, s.dropped_total["invalid"], s.stored_groups) == (3, 3, 0)
    assert s.invariant_ok


async def test_oversized_group_gets_resource_exhausted_without_retry_hint(make_buffer) -> None:
    _, client = await make_buffer(buffer={"max_group_bytes": 2000})
    big = group_to_proto(make_group("big", gen_len=200))  # 2 x 203 tokens x 21 bytes > 2000
    stub = buffer_pb2_grpc.BufferServiceStub(client.channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Put(buffer_pb2.PutRequest(request_id="r", group=big))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_group_bytes=2000" in err.value.details()
    assert all(k != "retry-after-ms" for k, _ in err.value.trailing_metadata() or ())
    with pytest.raises(InvalidGroupError):
        await client.put(big)
    s = await client.stats()
    assert (s.put_total, s.dropped_total["invalid"], s.stored_bytes) == (1, 1, 0)


async def test_backpressure_answers_resource_exhausted_with_retry_after(make_buffer) -> None:
    _, client = await make_buffer(buffer={"max_stored_groups": 2, "retry_after_ms": 40})
    await client.put(make_group("a"))
    await client.put(make_group("b"))
    stub = buffer_pb2_grpc.BufferServiceStub(client.channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Put(buffer_pb2.PutRequest(request_id="c", group=group_to_proto(make_group("c"))))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(err.value.trailing_metadata())["retry-after-ms"] == "40"
    assert (await client.stats()).put_total == 2  # refused, not decided

    async def trainer() -> None:
        out = await client.claim(2, consumer_id="t", wait_ms=5000)
        await client.ack(out.group_ids)

    # the client waits out the backpressure and succeeds once the trainer has acked
    put_task = asyncio.create_task(client.put(make_group("c")))
    await trainer()
    assert (await put_task).result == "admitted"
    s = await client.stats()
    assert (s.put_total, s.acked_total, s.pending) == (3, 2, 1) and s.invariant_ok


async def test_stale_and_dapo_filtered_puts(make_buffer) -> None:
    _, client = await make_buffer(
        buffer={"filter": "dapo_equal_rewards"}, rollout={"max_head_offpolicyness": 1}
    )
    assert await client.set_version(3) == 3
    stale = await client.put(make_group("s", version=3, oldest=1))  # 3 - 1 = 2 > 1
    assert stale.result == "stale" and "oldest token version 1 < version 3" in stale.reason
    same = await client.put(make_group("f", version=3, rewards=(1.0, 1.0, 1.0)))
    assert same.result == "filtered" and "dapo_equal_rewards" in same.reason
    ok = await client.put(make_group("k", version=2, rewards=(0.0, 1.0)))
    assert ok.result == "admitted"
    s = await client.stats()
    assert dict(s.dropped_total) == {
        "stale_at_put": 1,
        "stale_at_claim": 0,
        "filtered": 1,
        "invalid": 0,
    }
    assert s.invariant_ok


async def test_filter_at_claim_drops_and_replaces(make_buffer) -> None:
    _, client = await make_buffer(buffer={"filter": "dapo_equal_rewards", "filter_at": "claim"})
    for gid, rewards in [
        ("a", (1.0, 1.0)),
        ("b", (0.0, 1.0)),
        ("c", (0.0, 0.0)),
        ("d", (1.0, 0.0)),
    ]:
        assert (await client.put(make_group(gid, rewards=rewards))).result == "admitted"
    out = await client.claim(2, consumer_id="t")
    assert out.group_ids == ["b", "d"]
    s = await client.stats()
    assert (s.dropped_total["filtered"], s.in_flight, s.pending, s.accepted) == (2, 2, 0, 2)
    # not enough acceptable groups and no partial batches: what was taken is given back
    await client.put(make_group("e", rewards=(0.0, 1.0)))
    await client.put(make_group("f", rewards=(0.0, 0.0)))
    assert (await client.claim(2, consumer_id="t")).groups == []
    s = await client.stats()
    assert (s.pending, s.dropped_total["filtered"]) == (1, 3) and s.invariant_ok


async def test_version_refuses_to_go_back(make_buffer) -> None:
    _, client = await make_buffer()
    assert await client.set_version(5) == 5
    with pytest.raises(VersionRegressionError) as err:
        await client.set_version(4)
    assert err.value.current == 5 and "only moves forward" in str(err.value)
    assert await client.get_version() == 5
    stub = buffer_pb2_grpc.BufferServiceStub(client.channel)
    with pytest.raises(grpc.aio.AioRpcError) as e2:
        await stub.SetVersion(buffer_pb2.SetVersionRequest(version=-1))
    assert e2.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "version" in e2.value.details()


async def test_claim_validation_and_waiting(make_buffer) -> None:
    _, client = await make_buffer()
    stub = buffer_pb2_grpc.BufferServiceStub(client.channel)
    for req, field in [
        (buffer_pb2.ClaimRequest(consumer_id="t", n_groups=0), "n_groups"),
        (buffer_pb2.ClaimRequest(consumer_id="", n_groups=1), "consumer_id"),
        (buffer_pb2.ClaimRequest(consumer_id="t", n_groups=1, wait_ms=-5), "wait_ms"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Claim(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field)

    async def late_producer() -> None:
        await asyncio.sleep(0.05)
        await client.put(make_group("late1"))
        await client.put(make_group("late2"))

    producer = asyncio.create_task(late_producer())
    out = await client.claim(2, consumer_id="t", wait_ms=30_000)  # returns when both arrived
    await producer
    assert out.group_ids == ["late1", "late2"]
    await client.put(make_group("lonely"))
    partial = await client.claim(3, consumer_id="t", wait_ms=20, allow_partial=True)
    assert partial.group_ids == ["lonely"]


async def test_reserve_and_release_over_grpc(make_buffer) -> None:
    _, client = await make_buffer(
        rollout={
            "consumer_batch_size": 2,
            "max_head_offpolicyness": 0,
            "max_concurrent_rollouts": 3,
        }
    )
    r = await client.reserve(5, rollout_id="r0", request_id="q")
    # min(3 - 0, (0+0+1)*2 - 0) = 2
    assert len(r.reservation_ids) == 2 and r.capacity == 0 and r.retry_after_ms == 0
    again = await client.reserve(5, rollout_id="r0", request_id="q")  # a retry: same grant
    assert again.reservation_ids == r.reservation_ids
    none = await client.reserve(1, rollout_id="r0")
    assert none.reservation_ids == [] and none.retry_after_ms == 500
    assert await client.release(r.reservation_ids[:1]) == 1
    c = await client.capacity()
    assert (c.capacity, c.running, c.accepted, c.version) == (1, 1, 0, 0)  # min(2, 2-1)
    g = make_group("g", reservation_id=r.reservation_ids[1])
    await client.put(g)
    c = await client.capacity()
    assert (c.capacity, c.running, c.accepted) == (1, 0, 1)  # min(3, 2 - 1)


async def test_a_held_reserve_is_granted_when_a_claim_frees_the_queue(make_buffer) -> None:
    """`wait_ms` holds a reservation with nothing to grant until capacity frees: here the
    queue term (`rollout.queue_size` = 2) frees when the trainer claims, and the held call
    answers with ids and retry_after_ms 0, without the client polling."""
    _, client = await make_buffer(
        rollout={
            "consumer_batch_size": 2,
            "max_head_offpolicyness": 2,
            "max_concurrent_rollouts": 8,
            "queue_size": 2,
        }
    )
    first = await client.reserve(8, rollout_id="r0")
    assert len(first.reservation_ids) == 2  # min(8, (2+0+1)*2, 2): the queue term
    for i, rid in enumerate(first.reservation_ids):
        await client.put(make_group(f"a{i}", reservation_id=rid))
    at_once = await client.reserve(1, rollout_id="r0")
    assert at_once.reservation_ids == [] and at_once.retry_after_ms == 500  # wait_ms 0
    held = asyncio.create_task(client.reserve(2, rollout_id="r0", request_id="h", wait_ms=60_000))
    claimed = await client.claim(2, consumer_id="t", wait_ms=10_000)
    assert len(claimed.groups) == 2
    granted = await held  # woken by the claim, long before its 60 s
    assert len(granted.reservation_ids) == 2 and granted.retry_after_ms == 0
    assert not held.cancelled()


async def test_reserve_carries_the_replicas_served_version(make_buffer) -> None:
    """`served_version` travels over gRPC (proto3 `optional`: 0 is a version, not unset)
    and the staleness term counts from min(buffer version, served); a negative one is
    refused with a message naming the field."""
    _, client = await make_buffer(
        rollout={
            "consumer_batch_size": 2,
            "max_head_offpolicyness": 0,
            "max_concurrent_rollouts": 10,
        }
    )
    await client.set_version(2)
    lagging = await client.reserve(10, rollout_id="r0", served_version=0)
    assert len(lagging.reservation_ids) == 2  # (0 + min(2, 0) + 1) * 2 - 0
    current = await client.reserve(10, rollout_id="r0", served_version=2)
    assert len(current.reservation_ids) == 4  # (0 + 2 + 1) * 2 - 2
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.reserve(1, rollout_id="r0", served_version=-1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "served_version" in (err.value.details() or "")


async def test_restarted_replica_releases_all_its_reservations(make_buffer) -> None:
    _, client = await make_buffer(
        rollout={
            "consumer_batch_size": 4,
            "max_head_offpolicyness": 0,
            "max_concurrent_rollouts": 8,
        }
    )
    dead = await client.reserve(3, rollout_id="rollout-0")
    other = await client.reserve(1, rollout_id="rollout-1")
    # min(8 - 4, (0+0+1)*4 - 4) = 0: the dead replica's 3 block the budget.
    assert (await client.capacity()).capacity == 0
    assert await client.release([], rollout_id="rollout-0") == 3
    c = await client.capacity()
    assert (c.capacity, c.running) == (3, 1)  # min(8 - 1, 4 - 1); rollout-1 keeps its one
    assert await client.release([], rollout_id="rollout-0") == 0  # retry is harmless
    assert await client.release(other.reservation_ids) == 1
    assert len(dead.reservation_ids) == 3
    # "rollout-1" must not match "rollout-10": prefixes end at the '#'.
    ten = await client.reserve(1, rollout_id="rollout-10")
    assert await client.release([], rollout_id="rollout-1") == 0
    assert await client.release(ten.reservation_ids) == 1


async def test_auth_token_is_required(make_buffer) -> None:
    service, client = await make_buffer(auth_token="s3cret")
    assert (await client.put(make_group("a"))).result == "admitted"
    async with grpc.aio.insecure_channel(service.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await buffer_pb2_grpc.BufferServiceStub(ch).GetVersion(common_pb2.Empty())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_redis_outage_unavailable_not_serving_then_recovers(
    make_buffer, redis_server
) -> None:
    service, client = await make_buffer(buffer={"health_check_interval_s": 0.05})
    client.retries = 0
    fsync_every_write(redis_server.url)  # "before" must survive the kill (not the test's topic)
    await client.put(make_group("before"))
    assert await health(service.address) == health_pb2.HealthCheckResponse.SERVING
    redis_server.kill()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.put(make_group("during"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "redis" in err.value.details()
    await wait_health(service.address, health_pb2.HealthCheckResponse.NOT_SERVING)
    async with httpx.AsyncClient() as http:
        ready = await http.get(f"http://127.0.0.1:{service.metrics_port}/readyz")
    assert ready.status_code == 503
    redis_server.start()  # same port and directory: the AOF is replayed
    await wait_health(service.address, health_pb2.HealthCheckResponse.SERVING)
    assert (await client.put(make_group("during"))).result == "admitted"
    s = await client.stats()
    assert (s.put_total, s.pending) == (2, 2) and s.invariant_ok


async def test_many_producers_and_a_consumer_over_grpc(make_buffer) -> None:
    """Invariant exact at the end; every admitted group served exactly once."""
    _, client = await make_buffer(
        buffer={"max_stored_groups": 12, "retry_after_ms": 5, "filter": "dapo_equal_rewards"},
        rollout={"max_head_offpolicyness": 1, "consumer_batch_size": 4},
    )
    rng = random.Random(3)
    n_producers, per_producer = 6, 12
    sent: dict[str, str] = {}
    finished = asyncio.Event()

    async def producer(p: int) -> None:
        for i in range(per_producer):
            gid = f"p{p}-{i}"
            v = await client.get_version()
            lag = rng.choice([0, 0, 0, 2])
            rewards = (1.0, 1.0) if rng.random() < 0.2 else (0.0, 1.0)
            if rng.random() < 0.1:
                bad = group_to_proto(make_group(gid))
                bad.trajectories[0].prompt_len = 0
                with pytest.raises(InvalidGroupError):
                    await client.put(bad)
                sent[gid] = "invalid"
                continue
            g = make_group(gid, version=v, oldest=max(0, v - lag), rewards=rewards)
            r = await client.put(g)
            sent[gid] = r.result
            if rng.random() < 0.2:  # a retried put
                assert (await client.put(g)).result == "duplicate"

    async def consumer() -> list[str]:
        got: list[str] = []
        while True:
            last = finished.is_set()  # decided before the claim: then take what is left
            out = await client.claim(4, consumer_id="t", wait_ms=20, allow_partial=last)
            got += out.group_ids
            if out.groups:
                await client.ack(out.group_ids, consumer_id="t")
                await client.set_version(out.version + 1)
            elif last:
                return got

    task = asyncio.create_task(consumer())
    await asyncio.gather(*(producer(p) for p in range(n_producers)))
    finished.set()
    got = await task
    s = await client.stats()
    results = list(sent.values())
    assert s.put_total == n_producers * per_producer == len(sent)
    assert s.admitted_total == results.count("admitted")
    assert s.dropped_total["stale_at_put"] == results.count("stale")
    assert s.dropped_total["filtered"] == results.count("filtered")
    assert s.dropped_total["invalid"] == results.count("invalid")
    assert len(got) == len(set(got)) == s.acked_total
    assert set(got) <= {g for g, r in sent.items() if r == "admitted"}
    assert s.acked_total + s.dropped_total["stale_at_claim"] == s.admitted_total
    assert (s.pending, s.in_flight) == (0, 0)
    assert s.invariant_ok


async def test_inspection_and_metrics(make_buffer) -> None:
    service, client = await make_buffer(rollout={"max_head_offpolicyness": 4})
    await client.set_version(2)
    for gid, v in [("a", 0), ("b", 1), ("c", 2)]:
        await client.put(make_group(gid, version=v))
    rows = await client.list_groups(1, -1)
    assert [(r.group_id, r.oldest_version, r.state) for r in rows] == [
        ("b", 1, "pending"),
        ("c", 2, "pending"),
    ]
    got = await client.read_group("b")
    assert_groups_equal(got, make_group("b", version=1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.read_group("nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.export("../../etc/evil.jsonl")
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "export_dir" in err.value.details()
    )

    out = await client.claim(2, consumer_id="t")  # a (staleness 2) and b (staleness 1)
    await client.ack(out.group_ids)
    await client.stats()  # refresh the snapshot behind /metrics
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{service.metrics_port}/metrics")).text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["flywheel_buffer_put_groups_total"] == 3
    assert values["flywheel_buffer_acked_groups_total"] == 2
    assert values["flywheel_buffer_pending_groups"] == 1
    assert values["flywheel_buffer_version"] == 2
    assert values["flywheel_buffer_invariant_ok"] == 1
    assert values['flywheel_buffer_dropped_groups_total{reason="stale_at_claim"}'] == 0
    assert values["flywheel_buffer_served_staleness_versions_count"] == 2
    assert values["flywheel_buffer_served_staleness_versions_sum"] == 3  # 2 + 1
    assert values['flywheel_buffer_served_staleness_versions_bucket{le="1.0"}'] == 1
    assert values["flywheel_buffer_redis_up"] == 1
    assert values['flywheel_buffer_put_results_total{result="admitted"}'] == 3


def test_put_response_enum_names_are_complete() -> None:
    # every admission result the proto knows has a name in the client (a new one must too)
    from services.buffer.client import _RESULT_NAMES

    known = set(buffer_pb2.AdmissionResult.values()) - {buffer_pb2.ADMISSION_RESULT_UNSPECIFIED}
    assert known == set(_RESULT_NAMES)


async def test_groups_outside_the_fast_check_are_decided_by_the_codec(make_buffer) -> None:
    _, client = await make_buffer()
    multi = make_group("multi", version=0)
    multi.trajectories[0].turn_ids = np.array([-1, -1, -1, 0, 0, 1, 1])
    multi.trajectories[1].logprobs = multi.trajectories[1].logprobs.astype(np.float64)
    assert (await client.put(multi)).result == "admitted"
    (got,) = (await client.claim(1, consumer_id="t")).groups
    np.testing.assert_array_equal(got.trajectories[0].turn_ids, [-1, -1, -1, 0, 0, 1, 1])


@pytest.mark.parametrize("where", ["put", "claim"])
async def test_a_failing_user_filter_answers_internal_and_loses_nothing(make_buffer, where) -> None:
    from . import helpers

    _, client = await make_buffer(
        buffer={"filter": f"{helpers.__name__}:exploding_filter", "filter_at": where}
    )
    client.retries = 0
    stub = buffer_pb2_grpc.BufferServiceStub(client.channel)
    req = buffer_pb2.PutRequest(request_id="p", group=group_to_proto(make_group("g")))
    if where == "put":
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Put(req)
        s = await client.stats()
        assert (s.put_total, s.stored_groups) == (0, 0)  # not decided: the producer may retry
    else:
        await stub.Put(req)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.claim(1, consumer_id="t")
        s = await client.stats()
        assert (s.put_total, s.pending, s.in_flight, s.claimed_total) == (1, 1, 0, 0)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError: boom on g" in err.value.details()
    assert s.invariant_ok


def read_cache_counts(service) -> tuple[float, float]:  # noqa: ANN001 - a BufferService
    """(hits, misses) of the replica's payload cache, from its own metrics."""
    get = service.registry.get_sample_value
    return tuple(
        get("flywheel_buffer_read_cache_total", {"result": r}) or 0.0 for r in ("hit", "miss")
    )


async def test_claims_come_from_memory_where_it_holds_the_bytes_and_from_redis_elsewhere(
    make_buffer,
) -> None:
    """Four replicas on one Redis: A took the puts (claims hit its cache); B has the cache
    off and D has it empty (the claim script carries the bytes, nothing is looked up); C
    holds only a group of its own (misses, read from Redis in a second round trip). All
    serve exactly the bytes that were put."""
    a_service, a = await make_buffer()
    b_service, b = await make_buffer(buffer={"read_cache_bytes": 0})
    c_service, c = await make_buffer()
    d_service, d = await make_buffer()
    groups = [make_group(f"g{i}", version=0) for i in range(8)]
    await a.put_many(groups)
    held = a_service.registry.get_sample_value("flywheel_buffer_read_cache_bytes")
    sizes = [len(group_to_proto(g).SerializeToString()) for g in groups]
    assert sum(sizes) < held < sum(sizes) + 100 * len(groups)  # the PutMany request: + ids
    own = make_group("c-own", version=0)
    await c.put(own)  # arrives after A's groups: served after them
    served = []
    for client, consumer in ((a, "ta"), (b, "tb"), (c, "tc"), (d, "td")):
        out = await client.claim(2, consumer_id=consumer)
        served += out.groups
        assert await client.ack(out.group_ids, consumer_id=consumer) == 2
    for sent, got in zip(groups, served, strict=True):
        assert_groups_equal(sent, got)
    counts = [read_cache_counts(x) for x in (a_service, b_service, c_service, d_service)]
    assert counts == [(2.0, 0.0), (0.0, 0.0), (0.0, 2.0), (0.0, 0.0)]
    last = await c.claim(1, consumer_id="tc")
    assert_groups_equal(own, last.groups[0])
    assert read_cache_counts(c_service) == (1.0, 2.0)
    # A forgets what it acked, but the request stays held by the groups acked elsewhere:
    # those age out by the byte bound.
    assert a_service.registry.get_sample_value("flywheel_buffer_read_cache_bytes") == held
    s = await a.stats()
    assert (s.put_total, s.acked_total, s.pending, s.in_flight) == (9, 8, 0, 1)
    assert s.invariant_ok


async def test_a_reused_group_id_is_not_served_the_bytes_of_its_earlier_admission(
    make_buffer,
) -> None:
    """A caches `g`; `g` is acked through B, its tombstone expires, and a different `g` is
    put through B. A's claim must serve the new bytes (the admission differs: a miss)."""
    a_service, a = await make_buffer()
    _, b = await make_buffer()
    old = make_group("g", version=0, rewards=(0.0, 1.0))
    new = make_group("g", version=0, rewards=(1.0, 1.0, 0.5))
    await a.put(old)
    out = await b.claim(1, consumer_id="tb")
    await b.ack(out.group_ids, consumer_id="tb")
    store = a_service.store
    await store.redis.delete(store._gkey("g"))  # noqa: SLF001 - as buffer.tombstone_ttl_s would
    assert (await b.put(new)).result == "admitted"
    got = await a.claim(1, consumer_id="ta")
    assert len(got.groups) == 1
    assert_groups_equal(new, got.groups[0])
    assert read_cache_counts(a_service) == (0.0, 1.0)


async def test_a_group_retired_between_its_claim_and_the_read_of_its_bytes_is_left_out(
    make_buffer,
) -> None:
    """The race the two-step claim opens: the script hands a group out, then (redelivered and
    acked by another consumer) its bytes are gone before they are read. It is not served."""
    service, _ = await make_buffer(buffer={"read_cache_bytes": 1})  # too small to hold any
    store, servicer = service.store, service.servicer
    for gid in ("kept", "gone"):
        await store.put(
            group_id=gid,
            oldest_version=0,
            newest_version=0,
            n_trajectories=1,
            payload=f"bytes of {gid}".encode(),
        )
    out = await store.claim(consumer_id="t", n_groups=2, allow_partial=False, with_payloads=False)
    assert [g.payload for g in out.groups] == [None, None]
    assert await store.ack(["gone"]) == 1
    filled = await servicer._with_payloads(out.groups)  # noqa: SLF001
    assert [(g.group_id, g.payload) for g in filled] == [("kept", b"bytes of kept")]
    assert read_cache_counts(service) == (0.0, 2.0)


async def test_group_images_survive_put_and_claim_byte_for_byte(make_buffer) -> None:
    from tests.image_samples import encoded

    _, client = await make_buffer()
    images = [encoded(56, 56), encoded(40, 30, "JPEG")]
    group = make_group("vis")
    group.images = list(images)
    assert (await client.put(group)).stored
    out = await client.claim(1, consumer_id="trainer-0")
    assert_groups_equal(group, out.groups[0])
    assert out.groups[0].images == images


@pytest.mark.parametrize(
    ("images", "why"),
    [
        (lambda e: [e(8, 8), b"\x89PNG but not really"], "image 1: not a PNG or JPEG"),
        (lambda e: [e(8, 8)] * 9, "9 images (limit 8 per group)"),
        (lambda e: [e(8, 8) + b"\0" * (2 << 20)], "image 0 has 2097"),
        (lambda e: [e(4097, 4097, "JPEG")], "pixels (limit 16777216)"),
    ],
)
async def test_bad_images_are_refused_and_nothing_is_stored(make_buffer, images, why) -> None:  # noqa: ANN001
    from tests.image_samples import encoded

    _, client = await make_buffer()
    group = make_group("bad-images")
    group.images = images(encoded)
    with pytest.raises(InvalidGroupError, match=re.escape(why)):
        await client.put(group)
    s = await client.stats()
    assert (s.put_total, s.dropped_total["invalid"], s.stored_groups, s.stored_bytes) == (
        1,
        1,
        0,
        0,
    )
    assert s.invariant_ok
