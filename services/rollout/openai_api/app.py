"""The routes of the OpenAI-compatible API of one rollout replica.

`/v1/...` serves plain calls. `/sessions/{id}/v1/...` serves the same calls and records
each one into session `id` (`sessions.py`), so an unmodified `openai.AsyncOpenAI(base_url=
".../sessions/{id}/v1")` produces a token-exact episode. `POST /sessions` opens a session
for an agent outside the replica, `GET /sessions/{id}` reads its records and `DELETE
/sessions/{id}` closes it. Every error is an OpenAI error body (`errors.py`); requests pass
the bearer-token and body-size guard first (`guards.py`).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Path
from fastapi.responses import JSONResponse, StreamingResponse

from services.rollout.openai_api.errors import ApiError, install_error_handlers
from services.rollout.openai_api.generation import ApiContext, run_chat, run_completion
from services.rollout.openai_api.guards import DEFAULT_MAX_BODY_BYTES, GuardMiddleware, TokenCheck
from services.rollout.openai_api.responses import (
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
)
from services.rollout.openai_api.schemas import (
    CallSummary,
    ChatCompletionRequest,
    CompletionRequest,
    SessionInfo,
    SessionRecord,
)
from services.rollout.openai_api.sessions import Session

SessionId = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]


def _summary(session: Session) -> SessionRecord:
    return SessionRecord(
        id=session.id,
        closed=session.closed,
        drift_turns=list(session.drift_turns),
        calls=[
            CallSummary(
                prompt_ids=c.prompt_ids,
                output_ids=c.output_ids,
                logprobs=c.logprobs,
                versions=c.versions,
                finish_reason=c.finish_reason,
                drift=c.drift,
                reused_prefix_tokens=c.reused_prefix_tokens,
            )
            for c in list(session.calls)
        ],
    )


def _counted(ctx: ApiContext, endpoint: str, status: int) -> None:
    if ctx.metrics is not None:
        ctx.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        ctx.metrics.sessions_open.set(len(ctx.store))  # in-process opens included


async def _chat(ctx: ApiContext, req: ChatCompletionRequest, sid: str | None) -> Any:
    try:
        gen = await run_chat(ctx, req, sid)
    except ApiError as err:
        _counted(ctx, "chat", err.status)
        raise
    _counted(ctx, "chat", 200)
    tok = ctx.bridge.tokenizer
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = chat_chunks(gen, req.model, tok, req.logprobs, req.top_logprobs, usage)
        return StreamingResponse(chunks, media_type="text/event-stream")
    return JSONResponse(chat_body(gen, req.model, tok, req.logprobs, req.top_logprobs))


async def _completion(ctx: ApiContext, req: CompletionRequest, sid: str | None) -> Any:
    try:
        gen = await run_completion(ctx, req, sid)
    except ApiError as err:
        _counted(ctx, "completions", err.status)
        raise
    _counted(ctx, "completions", 200)
    tok = ctx.bridge.tokenizer
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = completion_chunks(gen, req.model, tok, req.logprobs, usage)
        return StreamingResponse(chunks, media_type="text/event-stream")
    return JSONResponse(completion_body(gen, req.model, tok, req.logprobs))


def _models(ctx: ApiContext) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "flywheel"}
            for name in ctx.model_names
        ],
    }


def _v1_routes(ctx: ApiContext) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> dict[str, Any]:
        return _models(ctx)

    @r.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> Any:
        return await _chat(ctx, req, None)

    @r.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        return await _completion(ctx, req, None)

    return r


def _session_routes(ctx: ApiContext) -> APIRouter:
    r = APIRouter()

    def _get(sid: str) -> Session:
        try:
            return ctx.store.get(sid)
        except KeyError:
            raise ApiError(404, f"no open session {sid!r}", code="session_not_found") from None

    @r.post("/sessions")
    async def open_session() -> SessionInfo:
        session = ctx.store.open()
        if ctx.metrics is not None:
            ctx.metrics.sessions_open.set(len(ctx.store))
        return SessionInfo(id=session.id, base_url=f"/sessions/{session.id}/v1")

    @r.get("/sessions/{session_id}")
    async def read_session(session_id: SessionId) -> SessionRecord:
        return _summary(_get(session_id))

    @r.delete("/sessions/{session_id}")
    async def close_session(session_id: SessionId) -> SessionRecord:
        _get(session_id)
        session = ctx.store.close(session_id)
        if ctx.metrics is not None:
            ctx.metrics.sessions_open.set(len(ctx.store))
        return _summary(session)

    @r.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: SessionId) -> dict[str, Any]:
        _get(session_id)
        return _models(ctx)

    @r.post("/sessions/{session_id}/v1/chat/completions")
    async def session_chat(session_id: SessionId, req: ChatCompletionRequest) -> Any:
        return await _chat(ctx, req, session_id)

    @r.post("/sessions/{session_id}/v1/completions")
    async def session_completions(session_id: SessionId, req: CompletionRequest) -> Any:
        return await _completion(ctx, req, session_id)

    return r


def build_openai_app(ctx: ApiContext) -> FastAPI:
    """The FastAPI app with every route and error handler (no guard: see `guarded`)."""
    app = FastAPI(title="flywheel-rollout-openai", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(_v1_routes(ctx))
    app.include_router(_session_routes(ctx))
    return app


def guarded(
    app: Any, tokens: TokenCheck | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> GuardMiddleware:
    """`app` behind the bearer-token and body-size guard."""
    return GuardMiddleware(app, tokens=tokens or TokenCheck([]), max_bytes=max_body_bytes)
