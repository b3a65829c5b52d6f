"""Waiting in tests: on a condition with a deadline, never for a fixed time as a check.

`until` / `until_sync` poll a predicate and return as soon as it holds, failing with `what`
when the deadline passes first. `still_pending` / `still_pending_sync` hold a fault for a
given time while watching the calls it should not end: they return the moment one of the
calls finishes (so the test fails then, naming it) instead of sleeping and looking once;
`holds` does the same for a condition that must stay true.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.01


async def until(
    cond: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = 60.0
) -> None:
    """Return once `cond()` (awaited when it returns an awaitable) is true; fail naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await _value(cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(POLL_S)


def until_sync(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """The blocking twin of `until`."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL_S)


async def holds(cond: Callable[[], bool], what: str, hold_s: float) -> None:
    """Assert that `cond()` stays true for `hold_s` seconds (an outage the test keeps up for
    that long), failing the moment it is false."""
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline:
        assert cond(), f"no longer true during the outage: {what}"
        await asyncio.sleep(POLL_S)
    assert cond(), f"no longer true at the end of the outage: {what}"


async def still_pending(*calls: asyncio.Future, hold_s: float) -> None:
    """Assert that none of `calls` finishes within `hold_s` seconds (an outage the test
    keeps up for that long); fails at the moment one does, with its outcome."""
    done, _ = await asyncio.wait(calls, timeout=hold_s, return_when=asyncio.FIRST_COMPLETED)
    assert not done, f"finished during the outage: {[_outcome(c) for c in done]}"


def still_pending_sync(*calls: concurrent.futures.Future, hold_s: float) -> None:
    """The blocking twin of `still_pending`, for `concurrent.futures` futures."""
    done, _ = concurrent.futures.wait(
        calls, timeout=hold_s, return_when=concurrent.futures.FIRST_COMPLETED
    )
    assert not done, f"finished during the outage: {[_outcome(c) for c in done]}"


async def _value(result: bool | Awaitable[bool]) -> bool:
    return await result if isinstance(result, Awaitable) else result


def _outcome(call: asyncio.Future | concurrent.futures.Future) -> object:
    exc = call.exception()
    return exc if exc is not None else call.result()
