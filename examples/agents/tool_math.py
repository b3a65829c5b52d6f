"""A tool-using agent written with the official `openai` client: multiply with a calculator.

Flywheel runs `run(client, data)` once per sample (`rollout.workflow: agent`,
`rollout.agent.path: examples.agents.tool_math:run`), with `client` bound to a fresh
session of the rollout replica, so every token the model samples here is recorded and
trained on. The agent offers one tool, `calculator`; when the model calls it, the call runs
in Flywheel's tool sandbox (a separate process with a deadline, a memory limit and none of
Flywheel's credentials) and the result goes back as a `tool` message. The episode ends
when the model answers without a call; the reward is 1 when the last number of that
answer is the product, else 0.

With `TOOLS = False` (`run_without_tool`) the same question is asked with no tool: the
baseline of what the model can do in its head.
"""

from __future__ import annotations

import json
import re
from typing import Any

import openai

from services.reward.tools.calculator import SCHEMA as CALCULATOR
from services.reward.tools.sandbox import SandboxConfig, ToolSandbox

MAX_CALLS = 3
"""Model calls per episode: a tool call, the answer, and one retry."""

MAX_TOKENS = 48
"""Tokens per model call: a call or a one-line answer fits."""

SYSTEM = (
    "You are a careful assistant. For any multiplication, call the calculator tool, "
    "then answer with just the number."
)

_NUMBER = re.compile(r"-?\d[\d,]*")
_sandbox: ToolSandbox | None = None
_model: str | None = None


def sandbox() -> ToolSandbox:
    """One sandbox per process, started on first use (its workers start lazily)."""
    global _sandbox
    if _sandbox is None:
        _sandbox = ToolSandbox(SandboxConfig(deadline_s=5.0, memory_bytes=256 << 20))
    return _sandbox


async def model_name(client: openai.AsyncOpenAI) -> str:
    global _model
    if _model is None:
        _model = (await client.models.list()).data[0].id
    return _model


def last_number(text: str) -> int | None:
    found = _NUMBER.findall(text or "")
    return int(found[-1].replace(",", "")) if found else None


def reward(text: str, answer: str) -> float:
    """1.0 when the last number in `text` is the number after `####` in `answer`."""
    expected = last_number(answer.split("####")[-1])
    return float(expected is not None and last_number(text) == expected)


async def _tool_results(calls: list[Any]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            result = await sandbox().call(call.function.name, arguments)
            content = result.content
        else:
            content = "arguments must be a JSON object"
        out.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return out


async def episode(client: openai.AsyncOpenAI, data: dict[str, Any], tools: bool) -> float:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM if tools else "Answer with just the number."},
        {"role": "user", "content": str(data["prompt"])},
    ]
    model = await model_name(client)
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            tools=[CALCULATOR] if tools else openai.omit,  # type: ignore[list-item]
            temperature=1.0,
            max_tokens=MAX_TOKENS,
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            return reward(message.content or "", str(data["answer"]))
        messages.append(message.model_dump(exclude_none=True))
        messages.extend(await _tool_results(list(message.tool_calls)))
    return 0.0


async def run(client: openai.AsyncOpenAI, data: dict[str, Any]) -> float:
    """The agent Flywheel trains: the calculator offered."""
    return await episode(client, data, tools=True)


async def run_without_tool(client: openai.AsyncOpenAI, data: dict[str, Any]) -> float:
    """The baseline: the same question, no tool."""
    return await episode(client, data, tools=False)
