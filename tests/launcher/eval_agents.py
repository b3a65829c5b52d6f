"""Agents the launcher's agent-evaluation tests name by dotted path
(`tests.launcher.eval_agents:...`), each written with the official `openai` client."""

from __future__ import annotations

from typing import Any

import openai

from services.reward.tools.sandbox import SandboxConfig, ToolSandbox

_sandbox: ToolSandbox | None = None


def sandbox() -> ToolSandbox:
    global _sandbox
    if _sandbox is None:
        _sandbox = ToolSandbox(SandboxConfig(deadline_s=10.0))
    return _sandbox


async def _ask(client: openai.AsyncOpenAI, question: str) -> str:
    reply = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": question}], max_tokens=2
    )
    return reply.choices[0].message.content or ""


async def by_row(client: openai.AsyncOpenAI, data: dict[str, Any]) -> Any:
    """One model call, then what the row asks for: `tool` (an expression for the calculator,
    `bad` for a call that fails), `raise`, and `reward` (a number, or `none`)."""
    await _ask(client, str(data["prompt"]))
    if data.get("tool"):
        expression = "1 / 0" if data["tool"] == "bad" else str(data["tool"])
        await sandbox().call("calculator", {"expression": expression})
    if data.get("raise"):
        raise ValueError("the agent broke")
    return None if data["reward"] == "none" else {"reward": float(data["reward"]), "turns": 1}
