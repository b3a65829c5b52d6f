"""Calls into the engine from the HTTP server's thread.

The API is served by uvicorn in its own thread with its own event loop, while the engine
lives on the rollout service's loop (SGLang's HTTP session and the torch engine's futures
belong to that loop). `EngineBridge` submits each generation to the engine's loop with
`asyncio.run_coroutine_threadsafe` and awaits it through `asyncio.wrap_future`; cancelling
the HTTP request (client gone, deadline passed) cancels the engine call, which aborts the
request in the engine instead of letting it decode for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from services.core.types import Completion, SamplingParams


class EngineBridge:
    """Generation on `engine`, run on `loop` (None or the caller's loop: called directly)."""

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        timeout_s: float = 600.0,
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.timeout_s = timeout_s

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def version(self) -> int:
        return int(self.engine.version)

    def max_positions(self) -> int | None:
        """The longest sequence the engine accepts, when it says."""
        try:
            value = getattr(self.engine, "max_positions", None)
        except (AssertionError, RuntimeError):  # not started yet
            return None
        return int(value) if isinstance(value, int) else None

    async def generate_n(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        request_id: str,
        cache_key: str | None = None,
    ) -> list[Completion]:
        """`sampling.n_samples` completions; `TimeoutError` after `timeout_s`. A session's
        single-sample calls pass its id as `cache_key`, so an engine that keeps KV caches
        (the torch engine's native runner) prefills only what each call adds."""
        prompt = list(prompt_ids)
        coro: Any
        if (
            cache_key
            and sampling.n_samples == 1
            and getattr(self.engine, "keeps_prefix_cache", False)
        ):
            coro = _one(
                self.engine.agenerate(prompt, sampling, request_id=request_id, cache_key=cache_key)
            )
        else:
            coro = self.engine.agenerate_n(prompt, sampling, request_id=request_id)
        here = asyncio.get_running_loop()
        if self.loop is None or self.loop is here:
            return list(await asyncio.wait_for(coro, self.timeout_s))
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the engine's loop is closed: the replica is stopping
            coro.close()
            raise
        try:
            return list(await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s))
        finally:
            fut.cancel()  # no-op when done; aborts the engine call otherwise


async def _one(coro: Any) -> list[Completion]:
    return [await coro]
