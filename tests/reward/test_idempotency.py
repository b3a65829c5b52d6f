"""Request-id store (`services/reward/idempotency.py`), including concurrent retries."""

from __future__ import annotations

import asyncio

import pytest

from services.reward.idempotency import IdempotencyStore, RequestIdConflict
from tests.waiting import until


async def test_concurrent_and_later_retries_compute_once() -> None:
    store: IdempotencyStore[int] = IdempotencyStore(10)
    calls = 0
    gate = asyncio.Event()

    async def compute() -> int:
        nonlocal calls
        calls += 1
        await gate.wait()
        return 42

    dups: list[int] = []
    waiting = [
        asyncio.create_task(store.run("r1", b"fp", compute, on_duplicate=lambda: dups.append(1)))
        for _ in range(5)
    ]
    await until(lambda: len(dups) == 4, "the four retries to join the first call", 10)
    gate.set()
    assert await asyncio.gather(*waiting) == [42] * 5
    assert await store.run("r1", b"fp", compute) == 42
    assert calls == 1
    assert len(dups) == 4  # the first call computes, the four concurrent ones are duplicates


async def test_reused_id_with_other_content_is_refused() -> None:
    store: IdempotencyStore[int] = IdempotencyStore(10)

    async def compute() -> int:
        return 1

    await store.run("r", b"one", compute)
    with pytest.raises(RequestIdConflict, match="different request"):
        await store.run("r", b"two", compute)


async def test_failures_are_not_remembered_and_empty_id_is_not_stored() -> None:
    store: IdempotencyStore[int] = IdempotencyStore(10)
    attempts = 0

    async def flaky() -> int:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise RuntimeError("queue full")
        return 7

    with pytest.raises(RuntimeError):
        await store.run("r", b"fp", flaky)
    assert await store.run("r", b"fp", flaky) == 7  # the retry really ran
    assert await store.run("", b"fp", flaky) == 7
    assert attempts == 3 and len(store) == 1


async def test_caller_cancellation_does_not_cancel_the_work() -> None:
    store: IdempotencyStore[int] = IdempotencyStore(10)
    gate = asyncio.Event()

    running = asyncio.Event()

    async def compute() -> int:
        running.set()
        await gate.wait()
        return 5

    first = asyncio.create_task(store.run("r", b"fp", compute))
    await asyncio.wait_for(running.wait(), 10)  # the work has started
    first.cancel()  # the client timed out...
    gate.set()
    assert await store.run("r", b"fp", compute) == 5  # ...and its retry gets the answer


async def test_bound_evicts_oldest_finished() -> None:
    store: IdempotencyStore[int] = IdempotencyStore(2)

    async def one() -> int:
        return 1

    for rid in ("a", "b", "c"):
        await store.run(rid, b"fp", one)
    assert len(store) == 2
