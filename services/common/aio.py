"""Asyncio waits that a `Task.cancel()` always stops, and a stop that always ends a task.

On Python 3.11, `asyncio.wait_for` loses a cancellation that arrives after the awaited
thing finished but before `wait_for` resumed: it returns the result instead of raising
`CancelledError` (CPython gh-86296, fixed in 3.12 by rewriting `wait_for` on top of
`asyncio.timeout`). A service's background loop stopped with one `cancel()` then runs on,
and whoever awaits it to stop waits forever. The buffer's Redis monitor did, twice: in
its own `wait_for` on an event, and inside redis-py, which writes every command under a
`wait_for` when a socket timeout is set. `asyncio.timeout` (3.11+) keeps every
cancellation, so the waits here use it; `stop_task` covers the libraries we do not own by
cancelling again until the task has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

log = logging.getLogger(__name__)

RECANCEL_S = 5.0
"""How long `stop_task` lets a cancelled task run on before it cancels it again: long
enough for the task's own clean-up after a cancel (a release, a resume) to finish, short
enough that a lost cancel costs a stop only seconds."""


async def stop_task(task: asyncio.Task[Any], *, recancel_s: float = RECANCEL_S) -> None:
    """Cancel `task` and return once it is done, cancelling it again every `recancel_s`
    seconds while it runs on (a cancel lost inside a library's `wait_for`). The task's own
    outcome (result, exception or cancellation) is consumed, not raised: this is a stop."""
    attempts = 0
    while not task.done():
        if attempts:
            log.info(  # handled, and harmless: worth a line, not an operator's attention
                "task ran on after its cancel; cancelling it again",
                extra={"task": task.get_name(), "attempt": attempts + 1},
            )
        task.cancel()
        attempts += 1
        await asyncio.wait({task}, timeout=recancel_s)
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved


async def _within(awaitable: Awaitable[Any], timeout: float) -> bool:
    """True when `awaitable` finished within `timeout` seconds (3.11's `asyncio.timeout`,
    which keeps the caller's cancellation, unlike `wait_for`)."""
    try:
        async with asyncio.timeout(timeout):
            await awaitable
    except TimeoutError:
        return False
    return True


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait until `event` is set or `timeout` seconds pass; True when it is set."""
    return await _within(event.wait(), timeout) or event.is_set()


async def wait_condition(condition: asyncio.Condition, timeout: float) -> bool:
    """`await condition.wait()` for at most `timeout` seconds (the caller holds its lock,
    and holds it again on return); True when notified."""
    return await _within(condition.wait(), timeout)
