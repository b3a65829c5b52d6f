"""The OpenAI `tools` entry of a one-argument tool, as an agent offers it to the model."""

from __future__ import annotations

from typing import Any


def one_argument_tool(name: str, description: str, argument: str, about: str) -> dict[str, Any]:
    """`{"type": "function", "function": {...}}` with one required string argument."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {argument: {"type": "string", "description": about}},
                "required": [argument],
            },
        },
    }
