"""The OpenAI-compatible API with SmolLM2-135M-Instruct, its real chat template and the
official `openai` client: prompts are exactly what Hugging Face's `apply_chat_template`
renders, a conversation with a tool round trip chains without drift, and a tool call the
model writes reaches the client as `tool_calls`, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.openai_api.render import tools_system_text
from services.rollout.openai_api.schemas import ToolSpec
from services.rollout.openai_api.sessions import export_concat
from tests import smollm2
from tests.rollout.openai_api.conftest import MODEL, Served, serve

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@pytest.fixture
async def smol() -> AsyncIterator[Served]:
    engine = TorchEngine(smollm2.model_dir(), max_batch_size=2, device="cpu")
    await engine.start()
    try:
        for s in serve(engine):
            try:
                yield s
            finally:
                await s.close()
    finally:
        await engine.stop()


async def test_smollm2_conversation_with_a_tool_round_trip(smol: Served) -> None:
    tok = smol.engine.tokenizer
    session = smol.store.open()
    client = smol.client(session.id)
    messages: list[dict] = [{"role": "user", "content": "What is 2 + 3?"}]
    first = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=12
    )
    # SmolLM2's template has no tool syntax: the tools arrive as a system message, and the
    # prompt is what HF renders for that conversation.
    system = tools_system_text([ToolSpec.model_validate(t) for t in TOOLS])
    want = tok.apply_chat_template(
        [{"role": "system", "content": system}, *messages], add_generation_prompt=True
    )
    assert session.calls[0].prompt_ids == list(want)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=8, stream=True
    )
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    one, two = session.calls
    assert streamed == tok.decode(two.output_ids, skip_special_tokens=True)
    # ChatML ends a turn with <|im_end|>, SmolLM2's EOS: the second prompt extends the first
    # prompt + output unless re-tokenising the answer text gives other ids than sampled.
    answer = one.output_ids[:-1] if one.stop_reason == "stop" else one.output_ids
    retokenised = tok(tok.decode(answer), add_special_tokens=False)["input_ids"]
    assert two.drift == (retokenised != answer)
    if not two.drift:
        assert two.reused_prefix_tokens == len(one.prompt_ids) + len(one.output_ids)
        traj = export_concat(session, reward=1.0, group_id="g", trajectory_id="t")
        assert traj.input_ids.tolist() == two.prompt_ids + two.output_ids
    want_two = tok.apply_chat_template(
        [{"role": "system", "content": system}, *messages], add_generation_prompt=True
    )
    assert two.prompt_ids == list(want_two)


def _calculator_call(expression: str, call_id: str) -> dict:
    args = json.dumps({"expression": expression})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "calculator", "arguments": args},
            }
        ],
    }


async def test_smollm2_writes_a_tool_call_the_client_reads(smol: Served) -> None:
    # Two worked examples in the conversation; greedy SmolLM2 then calls the tool itself,
    # in the <tool_call> form the tool system text asks for.
    messages = [
        {"role": "user", "content": "What is 17 * 23?"},
        _calculator_call("17 * 23", "c1"),
        {"role": "tool", "tool_call_id": "c1", "content": "391"},
        {"role": "assistant", "content": "391"},
        {"role": "user", "content": "What is 41 * 12?"},
        _calculator_call("41 * 12", "c2"),
        {"role": "tool", "tool_call_id": "c2", "content": "492"},
        {"role": "assistant", "content": "492"},
        {"role": "user", "content": "What is 123 * 45?"},
    ]
    client = smol.client()
    kwargs = dict(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    r = await client.chat.completions.create(**kwargs)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "123 * 45"}
    stream = await client.chat.completions.create(**kwargs, stream=True)
    chunks = [c async for c in stream]
    (streamed,) = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert (streamed.function.name, streamed.function.arguments) == (
        "calculator",
        call.function.arguments,
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
