"""Agents the agent-workflow tests name by dotted path (`tests.rollout.workflows.agents:...`):
each is what a user would write, with the official `openai` client."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import openai

CALLS: list[Any] = []
"""The chat completions the agents received (parsed by the `openai` client), in order."""

_count = itertools.count()


async def _ask(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], n: int = 3) -> Any:
    reply = await client.chat.completions.create(
        model="policy", messages=messages, max_tokens=n, temperature=1.0
    )
    CALLS.append(reply)
    return reply


async def two_turns(client: openai.AsyncOpenAI, data: dict[str, Any]) -> float:
    """Ask, feed a tool result back, ask again; reward 1."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": str(data["prompt"])}]
    first = await _ask(client, messages)
    messages.append({"role": "assistant", "content": first.choices[0].message.content or ""})
    messages.append({"role": "user", "content": "tool says: 46"})
    await _ask(client, messages)
    return 1.0


async def info_dict(client: openai.AsyncOpenAI, data: dict[str, Any]) -> dict[str, Any]:
    await _ask(client, [{"role": "user", "content": "hi"}])
    return {"reward": 0.5, "tool_calls": 2, "note": "not a number"}


async def unscored(client: openai.AsyncOpenAI, data: dict[str, Any]) -> None:
    await _ask(client, [{"role": "user", "content": "hi"}])


async def every_other_raises(client: openai.AsyncOpenAI, data: dict[str, Any]) -> float:
    await _ask(client, [{"role": "user", "content": "hi"}])
    if next(_count) % 2:
        raise RuntimeError("agent bug")
    return 1.0


async def raises(client: openai.AsyncOpenAI, data: dict[str, Any]) -> float:
    raise RuntimeError("agent bug")


async def hangs(client: openai.AsyncOpenAI, data: dict[str, Any]) -> float:
    await _ask(client, [{"role": "user", "content": "hi"}])
    await asyncio.Event().wait()  # never set: the agent hangs
    return 1.0


async def talks_forever(client: openai.AsyncOpenAI, data: dict[str, Any]) -> float:
    """Keeps calling the model and swallows the refusal, then claims success."""
    try:
        while True:
            await _ask(client, [{"role": "user", "content": "more"}], n=100)
    except openai.APIError:
        return 1.0


async def returns_text(client: openai.AsyncOpenAI, data: dict[str, Any]) -> str:
    await _ask(client, [{"role": "user", "content": "hi"}])
    return "great"


class ArealStyle:
    """AReaL 2.0's agent form: a class whose `run(data, **extra_kwargs)` builds its client."""

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        client = openai.AsyncOpenAI(
            base_url=extra_kwargs["base_url"],
            api_key=extra_kwargs["api_key"],
            http_client=extra_kwargs["http_client"],
            max_retries=0,
        )
        await _ask(client, [{"role": "user", "content": "hi"}])
        return 0.25
