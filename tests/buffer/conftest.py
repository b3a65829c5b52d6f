"""Fixtures of the buffer tests: a store on a real Redis, and real buffers on loopback gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from services.buffer.client import BufferClient
from services.buffer.service import BufferParts, BufferService
from services.buffer.store import RedisStore, StoreSettings, connect
from services.common.config import BufferConfig, RolloutConfig
from services.common.redis_server import RedisServer

PREFIX = "{test:exp:trial}:buf"


@pytest.fixture
async def make_store(
    redis_server: RedisServer,
) -> AsyncIterator[Callable[..., RedisStore]]:
    """`make_store(**settings)` -> a RedisStore on the test's redis-server."""
    stores: list[RedisStore] = []

    def make(**kw: Any) -> RedisStore:
        defaults: dict[str, Any] = {
            "prefix": PREFIX,
            "max_head_offpolicyness": 1,
            "consumer_batch_size": 2,
            "max_concurrent_rollouts": 4,
        }
        store = RedisStore(connect(redis_server.url), StoreSettings(**{**defaults, **kw}))
        stores.append(store)
        return store

    yield make
    for s in stores:
        await s.close()


BufferFactory = Callable[..., Awaitable[tuple[BufferService, BufferClient]]]


@pytest.fixture
async def make_buffer(redis_server: RedisServer, tmp_path: Any) -> AsyncIterator[BufferFactory]:
    """`await make_buffer(buffer={...}, rollout={...})` -> (running service, client)."""
    running: list[tuple[BufferService, BufferClient]] = []

    async def make(
        buffer: dict[str, Any] | None = None,
        rollout: dict[str, Any] | None = None,
        auth_token: str | None = None,
        client_kw: dict[str, Any] | None = None,
        parts: dict[str, Any] | None = None,
    ) -> tuple[BufferService, BufferClient]:
        bcfg = BufferConfig(**{"redis_url": redis_server.url, "claim_poll_ms": 5, **(buffer or {})})
        rcfg = RolloutConfig(
            **{"consumer_batch_size": 2, "max_head_offpolicyness": 1, **(rollout or {})}
        )
        service = BufferService(
            BufferParts(
                buffer=bcfg,
                rollout=rcfg,
                prefix=PREFIX,
                export_dir=str(tmp_path / "exports"),
                auth_token=auth_token,
                **(parts or {}),
            )
        )
        await service.start()
        client = BufferClient(service.address, auth_token=auth_token, **(client_kw or {}))
        running.append((service, client))
        return service, client

    yield make
    for service, client in running:
        await client.close()
        await service.stop(grace=0.5)
