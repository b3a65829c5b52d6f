"""Tool-call parsing (services/rollout/openai_api/tool_calls.py).

Formats: Qwen2.5's and Hermes 2 Pro's chat templates ask for one JSON object
`{"name": ..., "arguments": {...}}` per `<tool_call>...</tool_call>` block; SmolLM2's
function-calling data writes a JSON list of such objects in one block. The expected
`arguments` strings are what `json.dumps` of the arguments gives (OpenAI sends arguments
as a JSON string).
"""

from __future__ import annotations

import json

import pytest

from services.rollout.openai_api.tool_calls import parse_tool_calls, render_call_text


def test_hermes_blocks_become_calls_and_the_rest_is_content() -> None:
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "123*45"}}\n</tool_call>\n'
        '<tool_call>{"name": "clock", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert not parsed.malformed
    assert parsed.content == "Let me compute."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("calculator", {"expression": "123*45"}),
        ("clock", {"tz": "UTC"}),
    ]
    ids = [c.to_openai()["id"] for c in parsed.calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_smollm2_list_form_and_an_unclosed_last_block() -> None:
    text = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("a", "{}"), ("b", '{"x": 1}')]
    assert parsed.content is None


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "calculator", "arguments": {"expression": "1+',  # truncated
        '{"arguments": {}}',  # no name
        '["calculator"]',  # not an object
        '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
        "[]",
    ],
)
def test_malformed_blocks_come_back_as_plain_text(body: str) -> None:
    text = f"<tool_call>{body}</tool_call>"
    parsed = parse_tool_calls(text)
    assert parsed.malformed and parsed.calls == [] and parsed.content == text


def test_text_without_tags_is_content_and_calls_round_trip() -> None:
    assert parse_tool_calls("46").content == "46" and not parse_tool_calls("46").malformed
    written = render_call_text("add", '{"a": 1}')
    (call,) = parse_tool_calls(written).calls
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1})
