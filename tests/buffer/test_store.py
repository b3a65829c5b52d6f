"""The Redis store (services/buffer/store.py + scripts.py) against a real redis-server."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.buffer.store import PutItem, RedisStore

pytestmark = pytest.mark.integration


async def put(store: RedisStore, gid: str, ov: int = 0, resv: str = "", **kw):  # noqa: ANN201
    return await store.put(
        group_id=gid,
        oldest_version=ov,
        newest_version=ov,
        n_trajectories=2,
        payload=f"payload-of-{gid}".encode(),
        reservation_id=resv,
        **kw,
    )


async def test_capacity_sequence_follows_the_areal_rule(make_store) -> None:
    # eta = max_head_offpolicyness = 1, B = consumer_batch_size = 2, mcr = 4
    # capacity = min(mcr - running, (eta + v + 1) * B - (accepted + running))
    store = make_store(max_head_offpolicyness=1, consumer_batch_size=2, max_concurrent_rollouts=4)
    c = await store.capacity()
    assert (c.capacity, c.running, c.accepted) == (4, 0, 0)  # min(4 - 0, 2*2 - 0) = 4

    r1 = await store.reserve(count=3, rollout_id="r")
    assert len(r1.reservation_ids) == 3 and r1.capacity == 1  # min(4-3, 4-3) = 1
    r2 = await store.reserve(count=5, rollout_id="r")
    assert len(r2.reservation_ids) == 1 and r2.capacity == 0  # only 1 left
    r3 = await store.reserve(count=1, rollout_id="r")
    assert r3.reservation_ids == [] and r3.capacity == 0
    ids = r1.reservation_ids + r2.reservation_ids  # running = 4

    assert (await put(store, "g0", 0, ids[0])).result == "admitted"
    c = await store.capacity()  # running 3, accepted 1: min(4-3, 4-(1+3)) = 0
    assert (c.capacity, c.running, c.accepted) == (0, 3, 1)

    assert await store.release([ids[1], "no-such-reservation"]) == 1
    c = await store.capacity()  # running 2, accepted 1: min(4-2, 4-(1+2)) = 1
    assert (c.capacity, c.running, c.accepted) == (1, 2, 1)

    assert (await put(store, "g1", 0, ids[2])).result == "admitted"
    c = await store.capacity()  # running 1, accepted 2: min(4-1, 4-(2+1)) = 1
    assert (c.capacity, c.running, c.accepted) == (1, 1, 2)

    assert await store.set_version(1) == (True, 1)
    c = await store.capacity()  # v=1: min(3, (1+1+1)*2 - 3) = 3
    assert (c.capacity, c.version) == (3, 1)

    assert await store.set_version(3) == (True, 3)
    # oldest version 1 < 3 - 1 = 2: stale at put; its reservation is given back (rejected)
    assert (await put(store, "g2", 1, ids[3])).result == "stale"
    c = await store.capacity()  # running 0, accepted 2: min(4, (1+3+1)*2 - 2) = 4
    assert (c.capacity, c.running, c.accepted) == (4, 0, 2)

    # g0 and g1 (oldest 0 < 2) are stale at claim too: dropped, and no longer "accepted"
    out = await store.claim(consumer_id="t", n_groups=1, allow_partial=True)
    assert out.groups == [] and out.dropped_stale == 2
    c = await store.capacity()  # accepted 0: min(4, 10 - 0) = 4
    assert (c.capacity, c.accepted) == (4, 0)

    s = await store.stats()
    assert s.put == 3 and s.dropped["stale_at_put"] == 1 and s.dropped["stale_at_claim"] == 2
    assert s.invariant_ok  # 3 = 0 acked + 3 dropped + 0 pending + 0 in flight


async def test_capacity_counts_from_the_version_the_replica_serves(make_store) -> None:
    """AReaL's StalenessManager.get_capacity (areal/infra/staleness_manager.py) takes
    `current_version` from the inference engine, i.e. the weights the servers hold, which
    AReaL sets only after a weight update completes. A replica that says which version it
    serves (`served_version`) gets capacity from min(buffer version, served): while its
    update is in flight it may start only what will still be within eta when claimed."""
    # eta = 1, B = 2, mcr = 20: capacity = min(20 - running, (1 + v + 1) * 2 - (acc + run))
    store = make_store(max_head_offpolicyness=1, consumer_batch_size=2, max_concurrent_rollouts=20)
    assert await store.set_version(3) == (True, 3)
    behind = await store.reserve(count=20, rollout_id="r", served_version=1)
    assert len(behind.reservation_ids) == 6  # v = min(3, 1) = 1: (1 + 1 + 1) * 2 - 0
    assert behind.version == 3  # the answer still names the buffer's version
    more = await store.reserve(count=20, rollout_id="r", served_version=3)
    assert len(more.reservation_ids) == 4  # v = 3: (1 + 3 + 1) * 2 - 6
    ahead = await store.reserve(count=20, rollout_id="r", served_version=9)
    assert ahead.reservation_ids == []  # v = min(3, 9) = 3: 10 - 10, never above the buffer
    await store.release(behind.reservation_ids + more.reservation_ids)
    unsaid = await store.reserve(count=20, rollout_id="r")
    assert len(unsaid.reservation_ids) == 10  # no served_version: the buffer's version 3
    c = await store.capacity()  # the capacity probe itself is unchanged
    assert (c.capacity, c.running, c.version) == (0, 10, 3)


async def test_queue_size_bounds_the_lookahead_whatever_eta_allows(make_store) -> None:
    """AReaL's WorkflowExecutor bounds its output queue at `queue_size or
    max_concurrent_rollouts * 16` trajectories (areal/api/workflow_api.py): finished work the
    trainer has not taken back-pressures the rollout. Here the bound counts groups put and
    unclaimed plus groups being generated, so with queue_size = B the rollout holds at most
    one batch ahead however far eta would let it run."""
    # eta = 2, B = 2, mcr = 8, queue_size = 2:
    # capacity = min(8 - run, (2 + v + 1) * 2 - (acc + run), 2 - (pending + run))
    store = make_store(
        max_head_offpolicyness=2, consumer_batch_size=2, max_concurrent_rollouts=8, queue_size=2
    )
    c = await store.capacity()
    assert (c.capacity, c.running) == (2, 0)  # min(8, 6, 2): the queue term binds
    r = await store.reserve(count=8, rollout_id="r")
    assert len(r.reservation_ids) == 2 and r.capacity == 0
    for i, rid in enumerate(r.reservation_ids):
        assert (await put(store, f"a{i}", 0, rid)).result == "admitted"
    assert (await store.capacity()).capacity == 0  # two pending: min(8, 4, 0)
    out = await store.claim(consumer_id="t", n_groups=2, allow_partial=False)
    assert len(out.groups) == 2
    # Claimed groups leave the queue: the next batch may start at once, before the ack and
    # before the version moves (eta's term alone, (2 + 0 + 1) * 2 - 2 = 4, allows more).
    assert (await store.capacity()).capacity == 2
    assert await store.ack([g.group_id for g in out.groups]) == 2
    r2 = await store.reserve(count=8, rollout_id="r")
    assert len(r2.reservation_ids) == 2  # min(8, 4, 2)
    # Without a queue bound eta's term governs: the same state grants 4 - 2 = 2 more.
    unbounded = make_store(
        prefix="{test:exp:trial}:unbounded",
        max_head_offpolicyness=2,
        consumer_batch_size=2,
        max_concurrent_rollouts=8,
    )
    assert len((await unbounded.reserve(count=8, rollout_id="r")).reservation_ids) == 6
    assert (await store.stats()).invariant_ok


async def test_synchronous_mode_blocks_rollout_until_the_trainer_steps(make_store) -> None:
    # eta = 0, B = 2: capacity (0+v+1)*2 - (accepted+running) allows one batch per version
    store = make_store(max_head_offpolicyness=0, consumer_batch_size=2, max_concurrent_rollouts=8)
    r = await store.reserve(count=8, rollout_id="r")
    assert len(r.reservation_ids) == 2  # min(8, 2) at v=0
    for i, rid in enumerate(r.reservation_ids):
        assert (await put(store, f"a{i}", 0, rid)).result == "admitted"
    assert (await store.capacity()).capacity == 0  # 2 - (2 + 0)
    out = await store.claim(consumer_id="t", n_groups=2, allow_partial=False)
    assert [g.group_id for g in out.groups] == ["a0", "a1"]
    assert (await store.capacity()).capacity == 0  # claiming does not free the budget
    assert await store.ack(["a0", "a1"]) == 2
    assert (await store.capacity()).capacity == 0  # nor does acking: the version does
    await store.set_version(1)
    assert (await store.capacity()).capacity == 2  # (0+1+1)*2 - 2


async def test_stale_boundary_is_inclusive(make_store) -> None:
    store = make_store(max_head_offpolicyness=2)
    await store.set_version(5)
    assert (await put(store, "edge", 3)).result == "admitted"  # 5 - 3 = 2 <= eta
    assert (await put(store, "over", 2)).result == "stale"  # 5 - 2 = 3 > eta
    await store.set_version(6)  # now edge lags 3 > 2: stale at claim
    out = await store.claim(consumer_id="t", n_groups=1, allow_partial=True)
    assert out.groups == [] and out.dropped_stale == 1


async def test_claims_serve_oldest_version_first_then_arrival_order(make_store) -> None:
    store = make_store(max_head_offpolicyness=5)
    await store.set_version(2)
    for gid, ov in [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", 2)]:
        assert (await put(store, gid, ov)).result == "admitted"
    first = await store.claim(consumer_id="t", n_groups=3, allow_partial=False)
    assert [g.group_id for g in first.groups] == ["b", "d", "c"]
    assert [g.oldest_version for g in first.groups] == [0, 0, 1]
    rest = await store.claim(consumer_id="t", n_groups=2, allow_partial=False)
    assert [g.group_id for g in rest.groups] == ["a", "e"]
    assert rest.groups[0].payload == b"payload-of-a"


async def test_whole_batches_only_unless_partial(make_store) -> None:
    store = make_store()
    await put(store, "x")
    assert (await store.claim(consumer_id="t", n_groups=2, allow_partial=False)).groups == []
    s = await store.stats()
    assert (s.pending, s.in_flight) == (1, 0)  # nothing handed out
    out = await store.claim(consumer_id="t", n_groups=2, allow_partial=True)
    assert [g.group_id for g in out.groups] == ["x"]


async def test_put_and_ack_are_idempotent(make_store) -> None:
    store = make_store()
    assert (await put(store, "g")).result == "admitted"
    dup = await put(store, "g")
    assert (dup.result, dup.previous_state) == ("duplicate", "pending")
    out = await store.claim(consumer_id="t", n_groups=1, allow_partial=False)
    assert [g.group_id for g in out.groups] == ["g"]
    assert await store.ack(["g"]) == 1
    assert await store.ack(["g"]) == 0  # retried ack: harmless
    assert await store.ack(["never-put"]) == 0
    again = await put(store, "g")  # a very late retry of the put stores nothing either
    assert (again.result, again.previous_state) == ("duplicate", "acked")
    s = await store.stats()
    assert (s.put, s.acked, s.duplicate, s.pending, s.in_flight) == (1, 1, 2, 0, 0)
    assert s.stored_bytes == 0 and s.invariant_ok
    assert (await store.claim(consumer_id="t", n_groups=1, allow_partial=True)).groups == []


async def test_pipelined_puts_load_a_missing_script_and_run_each_once(make_store) -> None:
    """After SCRIPT FLUSH (as after a Redis restart) the pipelined puts load the script and
    send again only what NOSCRIPT refused: every group is put exactly once."""
    store = make_store()
    await put(store, "before")
    await store.redis.script_flush()
    items = [PutItem(f"g{i}", 0, 0, 2, f"payload-{i}".encode()) for i in range(3)]
    assert [o.result for o in await store.put_many(items)] == ["admitted"] * 3
    assert [o.result for o in await store.put_many(items)] == ["duplicate"] * 3
    s = await store.stats()
    assert (s.put, s.admitted, s.duplicate, s.pending) == (4, 4, 3, 4) and s.invariant_ok


async def test_ack_of_a_never_delivered_group_is_refused(make_store) -> None:
    store = make_store()
    await put(store, "g")
    assert await store.ack(["g"]) == 0  # pending, never handed out: not trained on
    assert (await store.stats()).pending == 1


async def test_retried_claim_returns_the_same_groups(make_store) -> None:
    store = make_store()
    for gid in "abc":
        await put(store, gid)
    first = await store.claim(consumer_id="t", n_groups=2, allow_partial=False, request_id="q")
    again = await store.claim(consumer_id="t", n_groups=2, allow_partial=False, request_id="q")
    assert [g.group_id for g in again.groups] == [g.group_id for g in first.groups] == ["a", "b"]
    assert again.replayed and [g.deliveries for g in again.groups] == [1, 1]
    s = await store.stats()
    assert (s.pending, s.in_flight, s.claimed) == (1, 2, 2)


async def test_retried_claim_after_the_version_moved_drops_what_went_stale(make_store) -> None:
    # A trainer claims at v1 (eta 1: oldest versions >= 0 are fresh), dies, and its successor
    # resumes at v3 and repeats the claim: 'a' (ov 0), 'b' and 'c' (ov 1) are now older than
    # v - eta = 2 and must not be served (a token 3 versions old with eta 2);
    # 'd' (ov 2) and 'e' (ov 3) are served by an ordinary claim instead.
    store = make_store()
    for gid, ov in (("a", 0), ("b", 1), ("c", 1), ("d", 2)):
        await put(store, gid, ov)
    await store.set_version(1)
    first = await store.claim(consumer_id="t", n_groups=3, allow_partial=False, request_id="q")
    assert [g.group_id for g in first.groups] == ["a", "b", "c"]
    await store.set_version(3)
    await put(store, "e", 3)
    again = await store.claim(consumer_id="t", n_groups=2, allow_partial=False, request_id="q")
    assert not again.replayed
    assert again.dropped_stale == 3  # a, b, c: all older than 3 - 1 = 2
    assert [g.group_id for g in again.groups] == ["d", "e"]
    assert all(3 - g.oldest_version <= 1 for g in again.groups)
    s = await store.stats()
    assert s.dropped["stale_at_claim"] == 3 and s.in_flight == 2 and s.invariant_ok


async def test_retried_claim_keeps_fresh_groups_and_refills_the_batch(make_store) -> None:
    store = make_store(max_head_offpolicyness=2)
    for gid, ov in (("a", 0), ("b", 2), ("c", 2)):
        await put(store, gid, ov)
    await store.set_version(2)
    first = await store.claim(consumer_id="t", n_groups=2, allow_partial=False, request_id="q")
    assert [g.group_id for g in first.groups] == ["a", "b"]
    await store.set_version(3)  # 'a' (ov 0) is now older than 3 - 2 = 1; 'b' is fresh
    again = await store.claim(consumer_id="t", n_groups=2, allow_partial=False, request_id="q")
    assert (again.dropped_stale, again.redelivered) == (1, 1)
    assert [g.group_id for g in again.groups] == ["b", "c"]  # b first: its place in the order
    assert [g.deliveries for g in again.groups] == [2, 1]
    s = await store.stats()
    assert (s.pending, s.in_flight, s.redelivered) == (0, 2, 1) and s.invariant_ok


async def test_redelivery_after_the_consumer_goes_idle(make_store) -> None:
    patient = make_store(claim_idle_ms=3_600_000)
    out = None
    for gid in "ab":
        await put(patient, gid)
    out = await patient.claim(consumer_id="dead", n_groups=2, allow_partial=False)
    assert len(out.groups) == 2
    # not idle for an hour yet: another consumer gets nothing
    assert (await patient.claim(consumer_id="alive", n_groups=1, allow_partial=True)).groups == []

    eager = make_store(claim_idle_ms=1)  # the same Redis state, seen with a 1 ms idle time
    await asyncio.sleep(0.01)
    out = await eager.claim(consumer_id="alive", n_groups=2, allow_partial=False)
    assert [g.group_id for g in out.groups] == ["a", "b"]
    assert out.redelivered == 2 and [g.deliveries for g in out.groups] == [2, 2]
    assert await patient.ack(["a", "b"]) == 2
    s = await patient.stats()
    assert (s.redelivered, s.claimed, s.acked, s.in_flight) == (2, 4, 2, 0) and s.invariant_ok


async def test_unclaim_restores_order_and_delivery_count(make_store) -> None:
    store = make_store()
    for gid in "abc":
        await put(store, gid)
    out = await store.claim(consumer_id="t", n_groups=2, allow_partial=False)
    assert await store.unclaim([g.group_id for g in out.groups], "someone-else") == 0
    assert await store.unclaim([g.group_id for g in out.groups], "t") == 2
    again = await store.claim(consumer_id="u", n_groups=3, allow_partial=False)
    assert [(g.group_id, g.deliveries) for g in again.groups] == [("a", 1), ("b", 1), ("c", 1)]
    assert (await store.stats()).claimed == 3


async def test_backpressure_by_groups_and_by_bytes(make_store) -> None:
    store = make_store(max_stored_groups=2, max_stored_bytes=10_000)
    assert (await put(store, "a")).result == "admitted"
    assert (await put(store, "b")).result == "admitted"
    full = await put(store, "c")
    assert (full.result, full.stored_groups) == ("full", 2)
    # a full answer stores nothing and counts nothing: the producer retries later
    s = await store.stats()
    assert (s.put, s.pending) == (2, 2) and s.invariant_ok
    await store.claim(consumer_id="t", n_groups=1, allow_partial=False)
    assert (await put(store, "c")).result == "full"  # in flight still counts as stored
    await store.ack(["a"])
    assert (await put(store, "c")).result == "admitted"

    small = make_store(prefix="{bytes}:buf", max_stored_bytes=30)
    assert (await put(small, "ab")).result == "admitted"  # b"payload-of-ab": 13 bytes
    assert (await put(small, "cd")).result == "admitted"  # 26 bytes
    assert (await put(small, "ef")).result == "full"  # 39 > 30


async def test_stale_and_filtered_puts_are_decided_even_when_full(make_store) -> None:
    store = make_store(max_stored_groups=1, max_head_offpolicyness=0)
    await put(store, "a")
    await store.set_version(1)
    assert (await put(store, "old", 0)).result == "stale"
    assert (await put(store, "boring", 1, filtered=True)).result == "filtered"
    s = await store.stats()
    assert s.dropped["stale_at_put"] == 1 and s.dropped["filtered"] == 1 and s.invariant_ok


async def test_version_only_moves_forward(make_store) -> None:
    store = make_store()
    assert await store.set_version(4) == (True, 4)
    assert await store.set_version(2) == (False, 4)
    assert await store.set_version(4) == (True, 4)  # same value: harmless
    assert await store.set_version(3, request_id="late-retry") == (False, 4)
    assert await store.get_version() == 4


async def test_invalid_puts_are_counted_once(make_store) -> None:
    store = make_store()
    r = await store.reserve(count=1, rollout_id="r")
    assert await store.put_invalid(group_id="bad", reservation_id=r.reservation_ids[0]) == (True, 0)
    assert await store.put_invalid(group_id="bad") == (False, 0)
    assert await store.put_invalid(request_id="q1") == (True, 0)
    assert await store.put_invalid(request_id="q1") == (False, 0)
    assert await store.put_invalid() == (True, 0)  # nothing to recognise a retry by
    s = await store.stats()
    assert (s.put, s.dropped["invalid"], s.running) == (3, 3, 0) and s.invariant_ok


async def test_retained_payloads_are_bounded(make_store) -> None:
    store = make_store(retain_acked_groups=2)
    for gid in "abc":
        await put(store, gid)
    await store.claim(consumer_id="t", n_groups=3, allow_partial=False)
    for gid in "abc":  # acked one by one: a first
        await store.ack([gid])
    assert await store.read_group("a") is None
    assert await store.read_group("c") == b"payload-of-c"
    s = await store.stats()
    assert (s.retained, s.stored_bytes) == (2, 0)
    states = {g.group_id: (g.state, g.has_payload) for g in await store.list_groups(0, 10)}
    assert states == {"a": ("acked", False), "b": ("acked", True), "c": ("acked", True)}


async def test_reply_budget(make_store) -> None:
    store = make_store(max_reply_bytes=30)
    for gid in ["aa", "bb", "cc"]:  # 13 bytes each
        await put(store, gid)
    out = await store.claim(consumer_id="t", n_groups=3, allow_partial=False)
    assert out.groups == [] and out.too_big_bytes == 39
    assert (await store.stats()).in_flight == 0
    out = await store.claim(consumer_id="t", n_groups=3, allow_partial=True)
    assert [g.group_id for g in out.groups] == ["aa", "bb"]  # 26 <= 30


async def test_reservations_expire(make_store) -> None:
    store = make_store(reservation_ttl_ms=1)
    await store.reserve(count=2, rollout_id="r")
    await asyncio.sleep(0.01)
    c = await store.capacity()
    assert c.running == 0 and c.capacity == 4
    assert (await store.stats()).reservations_expired == 2


async def test_counters_live_in_redis_not_in_the_process(make_store) -> None:
    first = make_store()
    await put(first, "a")
    await first.set_version(2)
    await first.close()
    second = make_store()  # a new process would see exactly this
    s = await second.stats()
    assert (s.put, s.pending, s.version, s.accepted) == (1, 1, 2, 1)


async def test_invariant_holds_at_every_instant_under_concurrency(make_store) -> None:
    """8 producers, 1 consumer bumping versions, 1 auditor reading snapshots meanwhile."""
    store = make_store(max_head_offpolicyness=1, max_stored_groups=40)
    rng = random.Random(7)
    plan = []  # (producer, gid, lag, filtered, invalid, repeat)
    for p in range(8):
        for i in range(30):
            kind = rng.random()
            plan.append(
                (p, f"p{p}-{i}", rng.choice([0, 0, 1, 3]), kind < 0.15, kind > 0.9, kind < 0.3)
            )
    answers: dict[str, str] = {}
    done = asyncio.Event()
    audits = 0

    async def producer(p: int) -> None:
        for _, gid, lag, filtered, invalid, repeat in [x for x in plan if x[0] == p]:
            if invalid:
                await store.put_invalid(group_id=gid)
                answers[gid] = "invalid"
                continue
            for _ in range(2 if repeat else 1):
                while True:
                    v = await store.get_version()
                    out = await put(store, gid, max(0, v - lag), filtered=filtered)
                    if out.result != "full":
                        break
                    await asyncio.sleep(0.001)
                answers.setdefault(gid, out.result)

    async def consumer() -> list[str]:
        got: list[str] = []
        while not done.is_set() or (await store.stats()).pending:
            out = await store.claim(consumer_id="t", n_groups=4, allow_partial=done.is_set())
            if out.groups:
                got += [g.group_id for g in out.groups]
                assert await store.ack([g.group_id for g in out.groups]) == len(out.groups)
                await store.set_version(await store.get_version() + 1)
            else:
                await asyncio.sleep(0.001)
        return got

    async def auditor() -> None:
        nonlocal audits
        while not done.is_set():
            s = await store.stats()
            assert s.invariant_ok, s
            audits += 1
            await asyncio.sleep(0)

    consumer_task = asyncio.create_task(consumer())
    audit_task = asyncio.create_task(auditor())
    await asyncio.gather(*(producer(p) for p in range(8)))
    done.set()
    got = await consumer_task
    await audit_task

    s = await store.stats()
    n_invalid = sum(1 for x in plan if x[4])
    n_repeats = sum(1 for x in plan if x[5] and not x[4])
    results = list(answers.values())
    assert s.put == len(plan)  # every distinct group decided exactly once
    assert s.duplicate == n_repeats
    assert s.dropped["invalid"] == n_invalid
    assert s.dropped["stale_at_put"] == results.count("stale")
    assert s.dropped["filtered"] == results.count("filtered")
    assert len(got) == len(set(got))  # nothing served twice
    assert s.acked == len(got)
    assert s.admitted == results.count("admitted") == s.acked + s.dropped["stale_at_claim"]
    assert (s.pending, s.in_flight, s.stored_bytes) == (0, 0, 0)
    assert s.invariant_ok and audits > 0


async def test_a_claim_without_payloads_names_the_admission_and_redis_still_has_the_bytes(
    make_store,
) -> None:
    store = make_store()
    outcomes = {gid: await put(store, gid) for gid in "ab"}
    assert outcomes["a"].member != outcomes["b"].member and outcomes["a"].member.endswith(":a")
    out = await store.claim(consumer_id="t", n_groups=2, allow_partial=False, with_payloads=False)
    assert [(g.group_id, g.member, g.payload) for g in out.groups] == [
        (gid, outcomes[gid].member, None) for gid in "ab"
    ]
    assert await store.fetch_payloads(["a", "b"]) == [b"payload-of-a", b"payload-of-b"]
    assert await store.ack(["a"]) == 1
    assert await store.fetch_payloads(["a", "b", "never-put"]) == [None, b"payload-of-b", None]
    with_bytes = make_store(claim_idle_ms=1)
    await asyncio.sleep(0.01)
    again = await with_bytes.claim(consumer_id="u", n_groups=1, allow_partial=False)
    assert [(g.group_id, g.member, g.payload) for g in again.groups] == [
        ("b", outcomes["b"].member, b"payload-of-b")
    ]
