"""Tool calls in a completion's text, parsed into OpenAI `tool_calls`.

The models Flywheel ships and Qwen/Hermes-style models write a call as a JSON object between
`<tool_call>` and `</tool_call>`: `{"name": ..., "arguments": {...}}`. SmolLM2's
function-calling data writes a JSON *list* of such objects inside the same tags, so a body
may be one object or a list of them. `arguments` may also arrive as a JSON string.

A completion whose tags hold anything else (truncated JSON, no name, not an object) is
returned whole as plain content with `malformed=True`, so the caller counts it: a policy
that writes broken calls is something to train away, never a server error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"(.*?)(?:" + re.escape(CLOSE_TAG) + r"|\Z)", re.S)


@dataclass
class ParsedCall:
    """One call: the function name and its arguments as a JSON string (OpenAI's form)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedCompletion:
    """The text left once calls are cut out (None when nothing else was said), the calls,
    and whether tags were found whose content could not be parsed."""

    content: str | None
    calls: list[ParsedCall]
    malformed: bool = False


def _one_call(obj: Any) -> ParsedCall:
    if not isinstance(obj, dict):
        raise ValueError("a tool call must be a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a non-empty string `name`")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool call `arguments` must be a JSON object")
    return ParsedCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def _calls_in(body: str) -> list[ParsedCall]:
    obj = json.loads(body)
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        raise ValueError("an empty list of tool calls")
    return [_one_call(item) for item in items]


def parse_tool_calls(text: str) -> ParsedCompletion:
    """Split `text` into content and tool calls (see the module docstring)."""
    if OPEN_TAG not in text:
        return ParsedCompletion(content=text, calls=[])
    calls: list[ParsedCall] = []
    try:
        for match in _BLOCK.finditer(text):
            calls.extend(_calls_in(match.group(1).strip()))
    except (ValueError, RecursionError):  # json.JSONDecodeError is a ValueError
        return ParsedCompletion(content=text, calls=[], malformed=True)
    rest = _BLOCK.sub("", text).strip()
    return ParsedCompletion(content=rest or None, calls=calls)


def render_call_text(name: str, arguments: str) -> str:
    """How an assistant's earlier call is written back into a prompt for a template that
    has no tool-call syntax of its own: the same tagged form the model is asked to use."""
    try:
        args: Any = json.loads(arguments) if arguments else {}
    except ValueError:
        args = arguments
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"
