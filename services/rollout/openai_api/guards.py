"""The API's gate: bearer-token authentication and a bound on request bodies.

Authentication uses the replica's gRPC secrets: the shared `services.auth_token`, or, when
`services.credentials` are set, the tokens of the roles that may call the rollout
service's `Generate` (admin, trainer, launcher). Tokens are compared as sha256 digests in
constant time, as the gRPC interceptor does; a token written `sha256:<hex>` is a digest.

Both guards are plain ASGI middleware, so a refusal costs no body parsing: a body over
`max_bytes` is refused with 413 as soon as its announced or received size passes the bound.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from typing import Any

from starlette.exceptions import HTTPException

from services.common.grpc_server import ROLE_METHODS
from services.rollout.openai_api.errors import ApiError, unauthorized

GENERATE_METHOD = "flywheel.v1.RolloutService/Generate"
DEFAULT_MAX_BODY_BYTES = 8 << 20
_OPEN_PATHS = frozenset({"/openapi.json"})

Scope = dict[str, Any]


def _digest(token: str) -> bytes:
    if token.startswith("sha256:"):
        return bytes.fromhex(token.removeprefix("sha256:"))
    return hashlib.sha256(token.encode()).digest()


def _may_generate(role: str) -> bool:
    service = GENERATE_METHOD.split("/", 1)[0]
    return any(p in ("*", GENERATE_METHOD, f"{service}/*") for p in ROLE_METHODS.get(role, ()))


def accepted_digests(auth_token: str | None, credentials: Mapping[str, str] | None) -> list[bytes]:
    """The digests of the tokens the API accepts; empty means no authentication."""
    if credentials:
        return [_digest(t) for role, t in credentials.items() if _may_generate(role)]
    return [_digest(auth_token)] if auth_token else []


class TokenCheck:
    """Does an `Authorization` header carry one of the accepted tokens?"""

    def __init__(self, digests: Iterable[bytes]) -> None:
        self.digests = list(digests)

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def allows(self, header: bytes | None) -> bool:
        if not self.enabled:
            return True
        if not header or not header.startswith(b"Bearer "):
            return False
        got = hashlib.sha256(header.removeprefix(b"Bearer ").strip()).digest()
        ok = False
        for expected in self.digests:  # no early exit: constant time per table
            ok |= hmac.compare_digest(got, expected)
        return ok


async def _send_error(send: Any, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Refuses unauthenticated requests (401) and bodies over `max_bytes` (413)."""

    def __init__(self, app: Any, *, tokens: TokenCheck, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.tokens = tokens
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if not path.endswith(tuple(_OPEN_PATHS)) and not self.tokens.allows(
            headers.get(b"authorization")
        ):
            await _send_error(send, unauthorized())
            return
        too_large = ApiError(
            413, f"request body over {self.max_bytes} bytes", code="request_too_large"
        )
        announced = headers.get(b"content-length")
        if announced is not None and (not announced.isdigit() or int(announced) > self.max_bytes):
            await _send_error(send, too_large)
            return
        seen = 0

        async def limited_receive() -> Any:
            # Raised inside the app, where FastAPI re-raises HTTP exceptions from body reading
            # and the error handlers give it the OpenAI body.
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, too_large.message)
            return message

        await self.app(scope, limited_receive, send)
