"""Claim and Ack cost the same whether the queue holds ten groups or thousands.

A fleet of a thousand replicas keeps tens of thousands of groups pending; the trainer's
claim must not scan them. Cost is counted, not timed: the Redis commands that one Claim and
one Ack run (scripts' inner calls included, from INFO commandstats), at two queue lengths.
This catches a loop of commands over the queue; one command that reads a whole range
(ZRANGE 0 -1) counts once either way, and is left to review.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from services.buffer.store import PutItem, RedisStore
from tests.buffer.conftest import PREFIX

pytestmark = pytest.mark.integration


def _calls(url: str) -> dict[str, int]:
    stats = redis.Redis.from_url(url).info("commandstats")
    return {name: int(v["calls"]) for name, v in stats.items()}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


async def _fill(store: RedisStore, n: int, tag: str) -> None:
    for lo in range(0, n, 500):
        items = [PutItem(f"{tag}-{i}", 0, 0, 1, b"x" * 64) for i in range(lo, min(n, lo + 500))]
        assert {o.result for o in await store.put_many(items)} == {"admitted"}


async def _claim_and_ack_cost(store: RedisStore, url: str) -> dict[str, int]:
    before = _calls(url)
    out = await store.claim(consumer_id="t", n_groups=4, allow_partial=False)
    assert len(out.groups) == 4
    await store.ack([g.group_id for g in out.groups])
    after = _calls(url)
    return {k: n for k, n in _delta(before, after).items() if k != "cmdstat_info"}


async def test_claim_and_ack_touch_as_much_at_5000_pending_as_at_10(
    make_store: Callable[..., RedisStore], redis_url: str
) -> None:
    store = make_store(max_stored_groups=100_000, max_stored_bytes=1 << 30)
    await _fill(store, 14, "short")
    await _claim_and_ack_cost(store, redis_url)  # loads the scripts: not part of the cost
    short = await _claim_and_ack_cost(store, redis_url)  # 10 pending
    await _fill(store, 5000, "long")
    long = await _claim_and_ack_cost(store, redis_url)
    assert short == long, (short, long)
    assert sum(long.values()) < 100  # a few commands per claimed group, not per pending one


async def test_release_rollout_reads_only_that_rollouts_reservations(
    make_store: Callable[..., RedisStore], redis_url: str
) -> None:
    """A restarting replica's ReleaseRollout must not read the whole fleet's reservations.

    With 1,024 replicas holding a few reservations each, a scan of every reservation per
    release grows with the fleet. The per-rollout index (`P:rr:<rollout>`) holds exactly the
    live reservations of its rollout: fulfilled and released ones leave it at once, so what
    ReleaseRollout reads is bounded by that replica's own concurrency."""
    store = make_store(
        max_concurrent_rollouts=10_000, consumer_batch_size=10_000, queue_size=1 << 40
    )
    for r in range(200):
        assert len((await store.reserve(count=5, rollout_id=f"other{r}")).reservation_ids) == 5
    mine = (await store.reserve(count=4, rollout_id="mine")).reservation_ids
    index = redis.Redis.from_url(redis_url)
    key = f"{PREFIX}:rr:mine"
    assert sorted(m.decode() for m in index.zrange(key, 0, -1)) == sorted(mine)

    # One fulfilled by a put, one released: both leave the index.
    item = PutItem("g-mine", 0, 0, 1, b"x", reservation_id=mine[0])
    assert (await store.put_many([item]))[0].result == "admitted"
    assert await store.release([mine[1]]) == 1
    assert sorted(m.decode() for m in index.zrange(key, 0, -1)) == sorted(mine[2:])

    assert await store.release_rollout("mine") == 2
    assert index.exists(key) == 0
    assert (await store.capacity()).running == 1000  # every other replica's reservation stays
    assert await store.release_rollout("other7") == 5
    assert (await store.capacity()).running == 995
