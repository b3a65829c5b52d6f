"""OpenAI-style error bodies and the handlers that turn every failure into one.

Clients written against the OpenAI API read `{"error": {"message", "type", "param",
"code"}}` and the HTTP status; the official `openai` package maps 400/401/404/413/422 to
its own exception classes from the status alone. So every refusal here, including
FastAPI's own request validation, leaves as such a body with a 4xx status, and a request
the server cannot answer never becomes an unhandled 500 with an HTML page.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A request the API refuses: HTTP `status`, OpenAI error `type`, offending `param`
    (dotted field name, or None) and a machine-readable `code` (or None)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unknown_model(model: str, served: list[str]) -> ApiError:
    return ApiError(
        404,
        f"The model {model!r} does not exist on this replica; it serves {served}.",
        param="model",
        code="model_not_found",
    )


def context_overflow(prompt_tokens: int, wanted: int, limit: int) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens; the messages use "
        f"{prompt_tokens} tokens and {wanted} more were asked for.",
        param="messages",
        code="context_length_exceeded",
    )


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "Missing or invalid bearer token (Authorization: Bearer <token>).",
        code="invalid_api_key",
    )


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that give every error path the OpenAI body."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _loc_to_param(tuple(first.get("loc", ())))
        msg = str(first.get("msg", "invalid request"))
        text = f"{param}: {msg}" if param else msg
        return JSONResponse(error_body(text, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 413: "request_too_large"}.get(exc.status_code)
        return JSONResponse(
            error_body(str(exc.detail), code=code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("openai api request failed", extra={"path": request.url.path})
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", type="server_error"),
            status_code=500,
        )
