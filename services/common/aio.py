"""Asyncio waits that a `Task.cancel()` always stops.

On Python 3.11, `asyncio.wait_for` loses a cancellation that arrives after the awaited
thing finished but before `wait_for` resumed: it returns the result instead of raising
`CancelledError` (CPython gh-86296, fixed in 3.12 by rewriting `wait_for` on top of
`asyncio.timeout`). A service's background loop that waits on an event with `wait_for`
and is stopped with `cancel()` then runs on, and whoever awaits it to stop waits forever
(the buffer's Redis monitor did, once the event was set at the moment of the cancel).
`asyncio.timeout` (3.11+) keeps every cancellation, so the waits here use it.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait until `event` is set or `timeout` seconds pass; True when it was set.
    A cancellation of the caller is never swallowed (unlike 3.11's `wait_for`)."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


async def wait_condition(condition: asyncio.Condition, timeout: float) -> bool:
    """`await condition.wait()` for at most `timeout` seconds (the caller holds its lock,
    and holds it again on return); True when notified. Cancellation is kept as above."""
    try:
        async with asyncio.timeout(timeout):
            await condition.wait()
    except TimeoutError:
        return False
    return True
