"""Request ids that make a retry harmless.

A client that timed out cannot know whether its ScoreBatch ran, so it retries with the
same `request_id`. The first call's work runs as its own task (a client that goes away
does not cancel it); a retry that arrives while it runs waits for the same result, and
one that arrives later gets the stored answer. Either way the items are scored once.

An id reused with different content is a caller bug, refused (`RequestIdConflict`)
rather than answered with someone else's results. Failures (queue full, shutting down)
are not stored, so the retry really runs.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class RequestIdConflict(ValueError):
    """The same request_id arrived with a different request."""


class IdempotencyStore(Generic[T]):
    """request_id → (fingerprint, future of the response), the newest `max_entries` kept."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[bytes, asyncio.Future[T]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def run(
        self,
        request_id: str,
        fingerprint: bytes,
        compute: Callable[[], Awaitable[T]],
        on_duplicate: Callable[[], None] | None = None,
    ) -> T:
        """The result of `compute()` for this id, computing it at most once."""
        if not request_id:
            return await compute()
        entry = self._entries.get(request_id)
        if entry is not None:
            seen_fingerprint, running = entry
            if seen_fingerprint != fingerprint:
                raise RequestIdConflict(
                    f"request_id {request_id!r} was already used for a different request; "
                    "use a fresh id for new work"
                )
            if on_duplicate is not None:
                on_duplicate()
            self._entries.move_to_end(request_id)
            return await asyncio.shield(running)
        future: asyncio.Future[T] = asyncio.ensure_future(compute())
        self._entries[request_id] = (fingerprint, future)
        future.add_done_callback(functools.partial(self._forget_failure, request_id))
        while len(self._entries) > self.max_entries:
            oldest_id, (_, oldest) = next(iter(self._entries.items()))
            if not oldest.done():
                break  # never evict work in flight; the bound is soft while it runs
            del self._entries[oldest_id]
        return await asyncio.shield(future)

    def _forget_failure(self, request_id: str, future: asyncio.Future[T]) -> None:
        if future.cancelled() or future.exception() is not None:
            entry = self._entries.get(request_id)
            if entry is not None and entry[1] is future:
                del self._entries[request_id]
