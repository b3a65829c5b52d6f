"""Fixtures of the OpenAI-compatible API tests: a started tiny-model engine, the API served
by a real uvicorn on loopback (the replica's side app, its own thread and event loop, as in
production), and official `openai` clients pointed at it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import openai
import pytest
from prometheus_client import CollectorRegistry

from services.common.http_app import MetricsServer
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.metrics import RolloutMetrics
from services.rollout.openai_api.app import build_openai_app, guarded
from services.rollout.openai_api.bridge import EngineBridge
from services.rollout.openai_api.generation import ApiContext
from services.rollout.openai_api.guards import TokenCheck, accepted_digests
from services.rollout.openai_api.sessions import SessionStore

MODEL = "tiny"
TOKEN = "s3cret-test-token"


@dataclass
class Served:
    """A replica's API on loopback: its engine, sessions, counters and base URL."""

    engine: TorchEngine
    store: SessionStore
    ctx: ApiContext
    metrics: RolloutMetrics
    url: str
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    def client(self, session_id: str | None = None, token: str = TOKEN) -> openai.AsyncOpenAI:
        base = f"{self.url}/sessions/{session_id}/v1" if session_id else f"{self.url}/v1"
        c = openai.AsyncOpenAI(api_key=token, base_url=base, max_retries=0, timeout=60)
        self.clients.append(c)
        return c

    async def close(self) -> None:
        for c in self.clients:
            await c.close()


def serve(engine: TorchEngine, *, max_body_bytes: int = 1 << 20) -> Iterator[Served]:
    metrics = RolloutMetrics()
    store = SessionStore(max_sessions=64)
    ctx = ApiContext(
        bridge=EngineBridge(engine, asyncio.get_running_loop(), timeout_s=60),
        store=store,
        model_names=[MODEL],
        default_max_tokens=8,
        metrics=metrics.openai_api,
    )
    app = guarded(build_openai_app(ctx), TokenCheck(accepted_digests(TOKEN, None)), max_body_bytes)
    server = MetricsServer("rollout", CollectorRegistry(), lambda: True, extra=app)
    port = server.start()
    try:
        yield Served(engine, store, ctx, metrics, f"http://127.0.0.1:{port}")
    finally:
        server.stop()


@pytest.fixture
async def served(engine: TorchEngine) -> AsyncIterator[Served]:
    """The API over `engine` (tests/rollout/conftest.py: the tiny model, started)."""
    for s in serve(engine):
        try:
            yield s
        finally:
            await s.close()
