"""The waits of services/common/aio.py keep every cancellation.

Reference: CPython gh-86296. On 3.11, `asyncio.wait_for` returns the awaited result when
the cancellation arrives after the inner wait finished but before `wait_for` resumed; a
background loop stopped with `cancel()` then never stops. The tests cancel at each of
the first few loop iterations after the event is set, which covers that window on 3.11
(`test_wait_for_of_this_python_loses_a_cancellation` shows the window exists here).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable

import pytest

from services.common.aio import stop_task, wait_condition, wait_event

GUARD_S = 30.0  # bounds a hung loop; nothing here measures speed
WINDOW = range(8)  # loop iterations between the set and the cancel
SETTLE = 20  # loop iterations a cancelled task gets to end in


async def _loop_forever(
    wait: Callable[[asyncio.Event], Awaitable[object]], event: asyncio.Event
) -> None:
    """The shape of the buffer's Redis monitor: wait on an event (or time out), clear it,
    do the periodic work, repeat until cancelled."""
    while True:
        await wait(event)
        event.clear()
        await asyncio.sleep(0)


async def _stops_when_cancelled(
    wait: Callable[[asyncio.Event], Awaitable[object]], iterations: int
) -> bool:
    event = asyncio.Event()
    task = asyncio.create_task(_loop_forever(wait, event))
    for _ in range(3):
        await asyncio.sleep(0)  # the task is now waiting on the event
    event.set()
    for _ in range(iterations):
        await asyncio.sleep(0)
    task.cancel()
    for _ in range(SETTLE):  # a cancelled task ends within a few iterations: no clock
        await asyncio.sleep(0)
    if not task.done():
        task.cancel()  # the second cancel lands inside the next wait
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, GUARD_S)
        return False
    return task.cancelled()


async def _wait_for(event: asyncio.Event) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), 10.0)


async def _wait_event(event: asyncio.Event) -> bool:
    return await wait_event(event, 10.0)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps cancels since 3.12")
async def test_wait_for_of_this_python_loses_a_cancellation() -> None:
    """The bug the module works around, reproduced: with 3.11's wait_for, a cancel at one
    of the iterations after the event is set does not stop the loop."""
    outcomes = [await _stops_when_cancelled(_wait_for, k) for k in WINDOW]
    assert not all(outcomes), outcomes


async def test_wait_event_loop_stops_at_every_moment_of_the_cancel() -> None:
    outcomes = [await _stops_when_cancelled(_wait_event, k) for k in WINDOW]
    assert all(outcomes), outcomes


async def test_wait_event_answers_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, 0.01) is True  # already set: no wait at all
    event.clear()
    asyncio.get_running_loop().call_soon(event.set)
    assert await wait_event(event, GUARD_S) is True


async def test_wait_condition_returns_on_notify_holding_the_lock() -> None:
    condition = asyncio.Condition()

    async def notify() -> None:
        async with condition:
            condition.notify_all()

    async with condition:
        assert await wait_condition(condition, 0.01) is False
        assert condition.locked()
        waker = asyncio.create_task(notify())
        assert await wait_condition(condition, GUARD_S) is True
        assert condition.locked()
    await waker


async def test_wait_condition_keeps_a_cancellation() -> None:
    condition = asyncio.Condition()

    async def waiter() -> None:
        async with condition:
            while True:
                await wait_condition(condition, 10.0)

    for k in WINDOW:
        task = asyncio.create_task(waiter())
        for _ in range(3):
            await asyncio.sleep(0)
        async with condition:
            condition.notify_all()
        for _ in range(k):
            await asyncio.sleep(0)
        task.cancel()
        for _ in range(SETTLE):
            await asyncio.sleep(0)
        assert task.done() and task.cancelled(), k


async def _loses_cancels(lost: int, log: list[str]) -> None:
    """A loop whose first `lost` cancels vanish, as inside a library's 3.11 `wait_for`
    (redis-py writes each command under one when a socket timeout is set)."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if len(log) >= lost:
                raise
            log.append("lost")


async def test_stop_task_ends_a_task_that_lost_its_cancels() -> None:
    log: list[str] = []
    task = asyncio.create_task(_loses_cancels(2, log))
    await asyncio.sleep(0)
    await stop_task(task, recancel_s=0.01)
    assert task.cancelled() and log == ["lost", "lost"]


async def test_stop_task_consumes_what_the_task_ended_with() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def returns() -> int:
        return 7

    failed, returned = asyncio.create_task(fails()), asyncio.create_task(returns())
    await asyncio.sleep(0)  # both have ended
    await stop_task(failed)
    await stop_task(returned)
    assert isinstance(failed.exception(), RuntimeError) and returned.result() == 7
