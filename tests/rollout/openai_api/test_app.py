"""The OpenAI-compatible API (services/rollout/openai_api/app.py) driven by the official
`openai` client over loopback HTTP against a real uvicorn and the tiny torch model.

References: the `openai` package parses every response into its own types (a field it does
not expect, or a malformed SSE stream, fails there); log-probabilities are recomputed with
the Hugging Face model's own forward; greedy tokens with HF `generate`.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from services.common.weights.manifest import make_manifest, named_parameters_for_update
from services.core.types import SamplingParams
from services.rollout.openai_api.sessions import export_concat, export_individual
from tests.rollout.conftest import load_model
from tests.rollout.engine.test_torch_engine import ATOL, fresh_logprobs, hf_greedy
from tests.rollout.openai_api.conftest import MODEL, Served
from tests.waiting import until

USER = [{"role": "user", "content": "12+34="}]


async def test_chat_returns_what_the_engine_samples(served: Served, tiny_model_dir) -> None:
    session = served.store.open()
    client = served.client(session.id)
    r = await client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, seed=7, logprobs=True, top_logprobs=1
    )
    (call,) = session.calls
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.usage.prompt_tokens == len(call.prompt_ids) == len("12+34=\n")
    assert r.usage.completion_tokens == len(call.output_ids)
    assert choice.finish_reason == {"stop": "stop", "length": "length"}[call.stop_reason]
    tok = served.engine.tokenizer
    assert choice.message.content == tok.decode(call.output_ids, skip_special_tokens=True)
    # The recorded prompt is the rendered conversation; the recorded output and logprobs are
    # what the engine samples for that prompt and seed.
    assert call.prompt_ids == tok("12+34=\n", add_special_tokens=False)["input_ids"]
    again = await served.engine.agenerate(call.prompt_ids, SamplingParams(max_new_tokens=6, seed=7))
    assert call.output_ids == again.output_ids and call.versions == again.versions == [0] * 6
    assert [t.logprob for t in choice.logprobs.content] == call.logprobs == again.logprobs
    ref = fresh_logprobs(load_model(tiny_model_dir), call.prompt_ids, call.output_ids)
    torch.testing.assert_close(torch.tensor(call.logprobs), ref, rtol=0, atol=ATOL)
    assert choice.logprobs.content[0].top_logprobs[0].token == choice.logprobs.content[0].token


async def test_greedy_n_choices_and_text_completions(served: Served, tiny_model_dir) -> None:
    client = served.client()
    r = await client.chat.completions.create(
        model=MODEL, messages=USER, n=3, temperature=0, max_completion_tokens=5
    )
    prompt = served.engine.tokenizer("12+34=\n", add_special_tokens=False)["input_ids"]
    want = hf_greedy(load_model(tiny_model_dir), prompt, 5)
    text = served.engine.tokenizer.decode(want, skip_special_tokens=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.message.content for c in r.choices} == {text}
    assert r.usage.completion_tokens == 3 * len(want)
    assert served.store.evicted == 0 and len(served.store) == 0  # plain calls record nothing

    done = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=1
    )
    assert done.choices[0].text == text
    assert done.choices[0].logprobs.tokens == [
        served.engine.tokenizer.decode([t], skip_special_tokens=False) for t in want
    ]


async def test_streaming_chunks_add_up_to_the_completion(served: Served) -> None:
    client = served.client()
    kwargs = dict(model=MODEL, messages=USER, max_tokens=6, seed=3, n=2)
    whole = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    text = {0: "", 1: ""}
    finish = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert text == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens


async def test_refusals_are_openai_errors(served: Served) -> None:
    client = served.client()
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model=MODEL, messages=USER, temperature=3)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="gpt-4o", messages=USER)
    assert missing.value.body["code"] == "model_not_found"
    # 512 positions in the tiny model: a long conversation, or a long answer, overflows.
    long = [{"role": "user", "content": "1" * 600}]
    for kwargs in (dict(messages=long), dict(messages=USER, max_tokens=600)):
        with pytest.raises(openai.BadRequestError) as overflow:
            await client.chat.completions.create(model=MODEL, **kwargs)
        assert overflow.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError) as denied:
        await served.client(token="wrong").models.list()
    assert denied.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        await served.client("no-such-session").chat.completions.create(model=MODEL, messages=USER)
    with pytest.raises(openai.BadRequestError):  # a session is one conversation
        session = served.store.open()
        await served.client(session.id).chat.completions.create(model=MODEL, messages=USER, n=2)
    big = {"model": MODEL, "messages": [{"role": "user", "content": "1" * (2 << 20)}]}
    async with httpx.AsyncClient() as http:
        r = await http.post(
            f"{served.url}/v1/chat/completions",
            json=big,
            headers={"Authorization": "Bearer s3cret-test-token"},
        )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    text = served.metrics.registry.get_sample_value(
        "flywheel_rollout_openai_requests_total", {"endpoint": "chat", "status": "404"}
    )
    assert text == 2.0  # the unknown model and the unknown session


async def test_tools_and_tool_results_reach_the_prompt(served: Served) -> None:
    # The tiny tokenizer has no chat template: tool definitions go into a system message
    # and an earlier call is written back in <tool_call> form (render.py).
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    session = served.store.open()
    client = served.client(session.id)
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "46"},
    ]
    await client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=2)
    await client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice="none", max_tokens=2
    )
    with_tools, without = (c.prompt_ids for c in session.calls)
    call = '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
    expected = f"12+34=\n{call}<eos>\n46\n"
    assert without == served.engine.tokenizer(expected, add_special_tokens=False)["input_ids"]
    # With tools, a system message describing them comes first.
    assert len(with_tools) > len(without) and with_tools[-len(without) :] == without


async def test_session_export_keeps_sampled_tokens_and_versions_across_an_update(
    served: Served, other_model_dir
) -> None:
    session = served.store.open()
    client = served.client(session.id)
    messages = list(USER)
    r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    messages += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "1+1="},
    ]
    new = named_parameters_for_update(load_model(other_model_dir))
    result = await served.engine.update_weights_from_tensors(new, make_manifest(new, 1))
    assert result.ok, result.message

    # Pause the engine after the second call's third token and update again (version 2):
    # the call in flight carries both versions, token by token.
    def pause_after_three(eng) -> None:  # noqa: ANN001
        outs = eng.active_outputs()
        if outs and len(outs[0]) >= 3:
            eng.request_pause()
            eng.on_step = None

    served.engine.on_step = pause_after_three
    second = asyncio.create_task(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=5)
    )
    await until(lambda: served.engine.paused and served.engine.active_outputs(), "pause")
    result = await served.engine.update_weights_from_tensors(new, make_manifest(new, 2))
    assert result.ok, result.message
    await served.engine.resume()
    await second
    first, call = session.calls
    assert first.versions == [0] * len(first.output_ids)
    assert len(call.output_ids) > 3
    assert call.versions == [1, 1, 1] + [2] * (len(call.output_ids) - 3)

    traj = export_concat(session, reward=1.0, group_id="g", trajectory_id="t")
    sampled = traj.loss_mask.astype(bool)
    assert traj.input_ids[sampled].tolist() == first.output_ids + call.output_ids
    assert traj.versions[sampled].tolist() == first.versions + call.versions
    assert traj.logprobs[sampled].tolist() == pytest.approx(first.logprobs + call.logprobs)
    assert set(traj.versions[~sampled].tolist()) == {-1}
    assert traj.turn_ids[sampled].tolist() == [0] * len(first.output_ids) + [1] * len(
        call.output_ids
    )
    if not call.drift:  # calls chain: the stream is exactly the last prompt + output
        assert traj.input_ids.tolist() == call.prompt_ids + call.output_ids
    per_call = export_individual(session, reward=0.5, group_id="g")
    assert [t.input_ids.tolist() for t in per_call] == [
        c.prompt_ids + c.output_ids for c in (first, call)
    ]
    assert [t.reward for t in per_call] == [0.5, 0.5]


KEEP = (
    "{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
)
# Like Qwen3's template, which drops earlier turns' reasoning: earlier assistant turns are
# rendered without their content, so the next prompt cannot extend what was sampled.
STRIP = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ eos_token }}"
    "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
)


@pytest.mark.parametrize("template", ["keep", "strip"])
async def test_template_drift_is_detected(served: Served, template: str) -> None:
    tok = served.engine.tokenizer
    tok.chat_template = KEEP if template == "keep" else STRIP
    served.ctx.renderer = None  # read the template again
    try:
        session = served.store.open()
        client = served.client(session.id)
        messages = list(USER)
        for _ in range(3):
            r = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, seed=11
            )
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "1+1="},
            ]
    finally:
        tok.chat_template = None
        served.ctx.renderer = None
    special = {tok.pad_token_id, tok.unk_token_id}
    expected = []
    for turn in (1, 2):
        prev = session.calls[turn - 1]
        # Keeping the content, only special tokens (dropped by decoding) break the chain.
        lost = (
            bool(prev.output_ids) if template == "strip" else bool(set(prev.output_ids) & special)
        )
        if lost:
            expected.append(turn)
    assert session.drift_turns == expected
    assert [c.drift for c in session.calls] == [t in expected for t in range(3)]
    drift = served.metrics.registry.get_sample_value("flywheel_rollout_template_drift_total")
    assert drift == len(expected)
    # The engine reused each call's cache for the next one, up to the shared prefix (its
    # last sampled token never went through the model, so it is not cached).
    kept = [len(c.prompt_ids) + len(c.output_ids) - 1 for c in session.calls]
    reusable = [
        min(c.reused_prefix_tokens, k) for c, k in zip(session.calls[1:], kept, strict=False)
    ]
    assert served.engine.reused_prefix_tokens == sum(reusable)
    traj = export_concat(session, reward=0.0, group_id="g", trajectory_id="t")
    sampled = traj.loss_mask.astype(bool)
    assert traj.input_ids[sampled].tolist() == sum((c.output_ids for c in session.calls), [])
    if expected:
        assert traj.metadata["template_drift_turns"] == ",".join(map(str, expected))
