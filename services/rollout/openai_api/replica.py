"""The API as one rollout replica serves it: built from the run's config and the replica's
engine, mounted on the replica's HTTP side app (`/healthz`, `/readyz`, `/metrics` stay
there, unauthenticated, for probes).

Served model names are the last part of `actor.path` and `actor.path` itself (see
`GET /v1/models`). Chat calls without `max_tokens` may generate `gconfig.max_new_tokens`.
The bearer token is the replica's gRPC secret (`guards.py`).
"""

from __future__ import annotations

import asyncio
from pathlib import PurePath
from typing import Any

from services.rollout.openai_api.app import build_openai_app, guarded
from services.rollout.openai_api.bridge import EngineBridge
from services.rollout.openai_api.generation import ApiContext
from services.rollout.openai_api.guards import TokenCheck, accepted_digests
from services.rollout.openai_api.sessions import SessionStore


def served_model_names(model_path: str) -> list[str]:
    names = [PurePath(model_path).name or model_path, model_path]
    return list(dict.fromkeys(n for n in names if n))


def replica_api(
    cfg: Any,
    engine: Any,
    store: SessionStore,
    *,
    loop: asyncio.AbstractEventLoop | None,
    metrics: Any = None,
) -> Any:
    """The guarded ASGI app of one replica; generation runs on `loop` (the engine's)."""
    ctx = ApiContext(
        bridge=EngineBridge(engine, loop, timeout_s=float(cfg.rollout.request_timeout)),
        store=store,
        model_names=served_model_names(str(cfg.actor.path)),
        default_max_tokens=int(cfg.gconfig.max_new_tokens),
        metrics=metrics,
    )
    s = cfg.services
    tokens = TokenCheck(accepted_digests(s.auth_token, s.credentials))
    return guarded(build_openai_app(ctx), tokens)
