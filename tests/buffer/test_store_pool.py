"""More concurrent calls than the buffer's Redis connections: they wait, none fails.

redis-py's default pool fails the call past its bound with "Too many connections", which the
buffer took for Redis being down. A fleet of a thousand replicas keeps that many calls in
flight; the bound must queue them, and the connections Redis sees must stay bounded.
"""

from __future__ import annotations

import asyncio

import pytest
import redis

from services.buffer.store import REDIS_CONNECTIONS, RedisStore, StoreSettings, connect

pytestmark = pytest.mark.integration


async def test_calls_past_the_pool_bound_wait_and_connections_stay_bounded(
    redis_url: str,
) -> None:
    store = RedisStore(
        connect(redis_url),
        StoreSettings(
            prefix="pool",
            max_head_offpolicyness=0,
            consumer_batch_size=1,
            max_concurrent_rollouts=1,
        ),
    )
    try:
        calls = 4 * REDIS_CONNECTIONS + 1  # 257: past redis-py's old default of 100
        # Each call keeps its connection busy a while (BLPOP on an empty key for 50 ms), so
        # they all overlap and more connections than the bound would be needed.
        results = await asyncio.gather(
            *(store.redis.blpop([f"empty-{i}"], timeout=0.05) for i in range(calls))
        )
        assert results == [None] * calls
        clients = redis.Redis.from_url(redis_url).client_list()
        assert len(clients) <= REDIS_CONNECTIONS + 1  # the pool's, plus this inspector
    finally:
        await store.close()
