"""An asyncio loop on a daemon thread, for rank 0's network I/O beside blocking torch work.

The training loop is synchronous torch code on the main thread; the gRPC clients (buffer,
rollout) and the trainer's own gRPC server are asyncio. They all live on this one loop,
and the main thread submits coroutines with `run(coro, timeout)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class IOLoop:
    def __init__(self, name: str = "trainer-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (exceptions propagate)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]):  # -> concurrent.futures.Future[T]
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, timeout: float = 5.0) -> None:
        if self.loop.is_closed():
            return

        async def _cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):  # best effort at shutdown
            self.run(_cancel_rest(), timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
