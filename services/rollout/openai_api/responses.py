"""OpenAI response bodies (and server-sent event chunks) from generated choices.

Log-probabilities are the engine's behaviour log-probabilities of the sampled tokens. The
engines report no alternatives, so `top_logprobs` lists the sampled token alone whatever
number was asked for. Streaming sends the whole completion once it is generated (the
engines return completions whole), in OpenAI's chunk format: a role chunk, a content (and
tool-call) chunk and a finish chunk per choice, an optional usage chunk, then `[DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from services.rollout.openai_api.generation import Choice, Generated


def _usage(gen: Generated) -> dict[str, int]:
    prompt = len(gen.prompt_ids)
    done = gen.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _token_text(tokenizer: Any, tok: int) -> str:
    return str(tokenizer.decode([tok], skip_special_tokens=False)) if tokenizer else str(tok)


def chat_logprobs(tokenizer: Any, choice: Choice, top: int | None) -> dict[str, Any]:
    content = []
    for tok, lp in zip(choice.completion.output_ids, choice.completion.logprobs, strict=True):
        text = _token_text(tokenizer, tok)
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode())}
        content.append({**entry, "top_logprobs": [entry] if top else []})
    return {"content": content, "refusal": None}


def _message(choice: Choice) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.calls:
        msg["tool_calls"] = [c.to_openai() for c in choice.calls]
    return msg


def chat_body(
    gen: Generated, model: str, tokenizer: Any, logprobs: bool, top: int | None
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": _message(c),
                "logprobs": chat_logprobs(tokenizer, c, top) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(gen.choices)
        ],
        "usage": _usage(gen),
    }


def _sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


def chat_chunks(
    gen: Generated,
    model: str,
    tokenizer: Any,
    logprobs: bool,
    top: int | None,
    include_usage: bool,
) -> Iterator[str]:
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(index: int, delta: dict[str, Any], finish: str | None, **extra: Any) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _sse({**head, "choices": [{**choice, **extra}]})

    for i, c in enumerate(gen.choices):
        yield chunk(i, {"role": "assistant", "content": ""}, None)
        if c.content:
            lp = chat_logprobs(tokenizer, c, top) if logprobs else None
            yield chunk(i, {"content": c.content}, None, logprobs=lp)
        if c.calls:
            calls = [{"index": j, **call.to_openai()} for j, call in enumerate(c.calls)]
            yield chunk(i, {"tool_calls": calls}, None)
        yield chunk(i, {}, c.finish_reason)
    if include_usage:
        yield _sse({**head, "choices": [], "usage": _usage(gen)})
    yield _sse("[DONE]")


def completion_logprobs(tokenizer: Any, choice: Choice, top: int | None) -> dict[str, Any]:
    tokens, offsets, pos = [], [], 0
    for tok in choice.completion.output_ids:
        text = _token_text(tokenizer, tok)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
    lps = list(choice.completion.logprobs)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=True)] if top else None,
        "text_offset": offsets,
    }


def completion_body(
    gen: Generated, model: str, tokenizer: Any, logprobs: int | None
) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "text": c.text,
                "logprobs": (
                    completion_logprobs(tokenizer, c, logprobs) if logprobs is not None else None
                ),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(gen.choices)
        ],
        "usage": _usage(gen),
    }


def completion_chunks(
    gen: Generated, model: str, tokenizer: Any, logprobs: int | None, include_usage: bool
) -> Iterator[str]:
    body = completion_body(gen, model, tokenizer, logprobs)
    for choice in body["choices"]:
        yield _sse({**body, "choices": [choice], "usage": None})
    if include_usage:
        yield _sse({**body, "choices": [], "usage": body["usage"]})
    yield _sse("[DONE]")
