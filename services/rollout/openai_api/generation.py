"""From a validated request to sampled choices: model check, prompt, limits, sampling,
generation, tool-call parsing and session recording. The routes (`app.py`) only add HTTP.

Defaults follow OpenAI's: temperature 1, top_p 1, n 1. Without `max_tokens` a chat call
may use `default_max_tokens` (the run's `gconfig.max_new_tokens`) or whatever is left of
the context, whichever is smaller; asking for more than the context holds is refused, as
OpenAI does, with `context_length_exceeded`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.core.types import Completion, SamplingParams
from services.rollout.openai_api.bridge import EngineBridge
from services.rollout.openai_api.errors import (
    ApiError,
    bad_request,
    context_overflow,
    unknown_model,
)
from services.rollout.openai_api.render import ChatRenderer
from services.rollout.openai_api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    ToolSpec,
)
from services.rollout.openai_api.sessions import CallRecord, Session, SessionStore
from services.rollout.openai_api.tool_calls import ParsedCall, parse_tool_calls

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class Choice:
    """One sampled answer: its completion, the text returned and parsed tool calls."""

    completion: Completion
    text: str
    finish_reason: str
    calls: list[ParsedCall] = field(default_factory=list)
    content: str | None = None
    record: CallRecord | None = None


@dataclass
class Generated:
    prompt_ids: list[int]
    choices: list[Choice]

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.completion.output_ids) for c in self.choices)


@dataclass
class ApiContext:
    """What the routes share: the engine, its template, the sessions, names and counters."""

    bridge: EngineBridge
    store: SessionStore
    model_names: list[str]
    default_max_tokens: int = 16384
    metrics: Any = None  # services.rollout.metrics.OpenAIApiCounters, or None
    renderer: ChatRenderer | None = None

    def chat_renderer(self) -> ChatRenderer:
        if self.renderer is None:
            self.renderer = ChatRenderer(self.bridge.tokenizer)
        return self.renderer

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise unknown_model(model, self.model_names)

    def session(self, session_id: str | None) -> Session | None:
        if session_id is None:
            return None
        try:
            session = self.store.get(session_id)
        except KeyError:
            raise ApiError(
                404, f"no open session {session_id!r}", param="session_id", code="session_not_found"
            ) from None
        if not session.has_room():
            raise bad_request(f"session {session_id!r} has reached its {session.max_calls} calls")
        return session


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def sampling_for(
    req: SamplingFields, *, prompt_len: int, max_tokens: int | None, ctx: ApiContext
) -> SamplingParams:
    """The engine's sampling parameters for a request whose prompt has `prompt_len` ids."""
    if req.presence_penalty:
        raise bad_request("presence_penalty is not supported (use 0)", param="presence_penalty")
    limit = ctx.bridge.max_positions()
    if limit is not None and (
        prompt_len >= limit or (max_tokens is not None and prompt_len + max_tokens > limit)
    ):
        raise context_overflow(prompt_len, max_tokens or 1, limit)
    max_new = max_tokens or ctx.default_max_tokens
    if limit is not None:
        max_new = min(max_new, limit - prompt_len)
    params = SamplingParams(
        n_samples=req.n,
        max_new_tokens=max_new,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        stop=req.stop_list(),
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
    )
    try:
        return params.validate()
    except ValueError as exc:
        raise bad_request(str(exc)) from exc


async def _generate(
    ctx: ApiContext, prompt: list[int], sampling: SamplingParams, session: Session | None
) -> list[Completion]:
    if session is not None and sampling.n_samples != 1:
        raise bad_request("a session is one conversation: use n=1 (one session per sample)", "n")
    try:
        return await ctx.bridge.generate_n(
            prompt,
            sampling,
            request_id=uuid.uuid4().hex,
            cache_key=session.id if session is not None else None,
        )
    except ValueError as exc:  # the engine refused the prompt or the parameters
        raise bad_request(str(exc)) from exc
    except TimeoutError as exc:
        raise ApiError(504, "generation did not finish in time", type="timeout") from exc
    except RuntimeError as exc:  # engine not started or stopping
        raise ApiError(503, f"the engine is not serving: {exc}", type="server_error") from exc


def _record(ctx: ApiContext, session: Session | None, prompt: list[int], choice: Choice) -> None:
    if session is None:
        return
    try:
        choice.record = session.record(prompt, choice.completion, choice.finish_reason)
    except ValueError as exc:  # closed or full meanwhile
        raise bad_request(str(exc)) from exc
    if ctx.metrics is not None:
        ctx.metrics.observe_call(choice.record, len(session.calls))


def _tools_in_use(req: ChatCompletionRequest) -> list[ToolSpec] | None:
    """The tools rendered: none for `tool_choice: none`, the named one for a named choice.
    Decoding is not constrained: `required` and a named choice only shape the prompt."""
    if not req.tools or req.tool_choice == "none":
        return None
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        named = [t for t in req.tools if t.function.name == choice.function.name]
        if not named:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not in tools",
                param="tool_choice",
            )
        return named
    return list(req.tools)


async def run_chat(
    ctx: ApiContext, req: ChatCompletionRequest, session_id: str | None
) -> Generated:
    ctx.check_model(req.model)
    session = ctx.session(session_id)
    tools = _tools_in_use(req)
    prompt = ctx.chat_renderer().render(req.messages, tools).ids
    max_tokens = req.max_completion_tokens or req.max_tokens  # the newer name wins
    sampling = sampling_for(req, prompt_len=len(prompt), max_tokens=max_tokens, ctx=ctx)
    completions = await _generate(ctx, prompt, sampling, session)
    choices = []
    for c in completions:
        text = _cut_at_stop(c.text, sampling.stop)
        choice = Choice(c, text, _FINISH.get(c.stop_reason, "stop"), content=text)
        if tools:
            parsed = parse_tool_calls(text)
            if parsed.malformed and ctx.metrics is not None:
                ctx.metrics.tool_call_parse_failures.inc()
            if parsed.calls:
                choice.calls, choice.content = parsed.calls, parsed.content
                choice.finish_reason = "tool_calls"
        _record(ctx, session, prompt, choice)
        choices.append(choice)
    return Generated(prompt, choices)


async def run_completion(
    ctx: ApiContext, req: CompletionRequest, session_id: str | None
) -> Generated:
    ctx.check_model(req.model)
    session = ctx.session(session_id)
    if isinstance(req.prompt, str):
        prompt = ctx.chat_renderer().encode(req.prompt)
    else:
        prompt = list(req.prompt)
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    sampling = sampling_for(req, prompt_len=len(prompt), max_tokens=req.max_tokens, ctx=ctx)
    completions = await _generate(ctx, prompt, sampling, session)
    choices = []
    for c in completions:
        text = _cut_at_stop(c.text, sampling.stop)
        choice = Choice(c, text, _FINISH.get(c.stop_reason, "stop"), content=text)
        _record(ctx, session, prompt, choice)
        choices.append(choice)
    return Generated(prompt, choices)
