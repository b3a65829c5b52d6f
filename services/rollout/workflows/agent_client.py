"""The OpenAI client an agent episode gets: bound to its session, held to its budget.

The client talks to the replica's own OpenAI-compatible app through an in-process ASGI
transport (`httpx.ASGITransport`): no socket, no second event loop, and the model calls
run on the rollout's loop, so cancelling the episode (its deadline) cancels the engine
request instead of leaving it to decode for nobody. The base URL is the session's
(`/sessions/{id}/v1`), so every call is recorded token for token.

`BudgetedTransport` sits in front and enforces the episode's limits before each call (the
session's recorded calls are the count): a call beyond `max_turns` or with the token
budget spent is refused with `BudgetExceeded`, and a call's `max_tokens` is lowered to
what the budget has left, so an agent that keeps talking gets short answers and then a
refusal, never more tokens than it was given. A refusal marks the episode failed with the
reason, whatever the agent then does with the error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

try:  # openai >= 3 speaks httpx2, its fork of httpx; older releases httpx itself
    import httpx2 as httpx
except ImportError:  # pragma: no cover - depends on the installed openai
    import httpx  # type: ignore[no-redef]

from services.common.config.agent import AgentConfig

BASE = "http://replica"
"""Host of the in-process transport (never resolved: requests go to the ASGI app)."""

_GENERATING = ("/chat/completions", "/completions")


class BudgetExceeded(Exception):
    """The episode asked for more than its budget; `reason` is the failure's name."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class EpisodeBudget:
    """What one episode may still do, read from its session's records."""

    session: Any  # services.rollout.openai_api.sessions.Session
    config: AgentConfig
    failure: str = ""
    """The first limit the episode hit (`max_turns`, `token_budget`, `context_budget`)."""

    @property
    def sampled_tokens(self) -> int:
        return sum(len(c.output_ids) for c in list(self.session.calls))

    def fail(self, reason: str, message: str) -> BudgetExceeded:
        self.failure = self.failure or reason
        return BudgetExceeded(reason, message)

    def admit(self) -> int:
        """Check a new call may start; returns the sampled tokens it may use."""
        calls = len(self.session.calls)
        if calls >= self.config.max_turns:
            raise self.fail("max_turns", f"episode used its {self.config.max_turns} model calls")
        left = self.config.max_tokens_per_episode - self.sampled_tokens
        if left <= 0:
            raise self.fail(
                "token_budget",
                f"episode sampled its {self.config.max_tokens_per_episode} tokens",
            )
        return left

    def check_last_call(self) -> None:
        """After a call: its prompt + completion within `engine_max_tokens`."""
        limit = self.config.engine_max_tokens
        calls = list(self.session.calls)
        if limit is None or not calls:
            return
        used = len(calls[-1].prompt_ids) + len(calls[-1].output_ids)
        if used > limit:
            raise self.fail("context_budget", f"a call used {used} tokens, more than {limit}")


def cap_max_tokens(body: dict[str, Any], left: int) -> dict[str, Any]:
    """`body` with its completion-token limit lowered to a share of `left` (per choice)."""
    n = body.get("n") or 1
    share = max(1, left // max(1, int(n)))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(key)
    body[key] = share if not isinstance(asked, int) or asked <= 0 else min(asked, share)
    return body


class BudgetedTransport(httpx.AsyncBaseTransport):
    """`inner` with the episode's budget checked around every generating call."""

    def __init__(self, inner: httpx.AsyncBaseTransport, budget: EpisodeBudget) -> None:
        self.inner = inner
        self.budget = budget

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        generating = request.method == "POST" and request.url.path.endswith(_GENERATING)
        if generating:
            left = self.budget.admit()
            request = _with_body(request, left)
        response = await self.inner.handle_async_request(request)
        if generating and response.status_code == 200:
            self.budget.check_last_call()
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def _with_body(request: httpx.Request, left: int) -> httpx.Request:
    try:
        body = json.loads(request.content or b"{}")
    except ValueError:
        return request  # the app answers a malformed body with a 400
    if not isinstance(body, dict):
        return request
    content = json.dumps(cap_max_tokens(body, left)).encode()
    headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
    return httpx.Request(request.method, request.url, headers=headers, content=content)


def episode_http_client(app: Any, budget: EpisodeBudget, timeout_s: float) -> httpx.AsyncClient:
    """An httpx client onto `app` in process, through the episode's budget."""
    transport = BudgetedTransport(httpx.ASGITransport(app=app), budget)
    return httpx.AsyncClient(transport=transport, base_url=BASE, timeout=timeout_s)


def session_base_url(session_id: str) -> str:
    return f"{BASE}/sessions/{session_id}/v1"
