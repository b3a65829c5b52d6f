"""Chat messages (and tools) rendered into prompt token ids with the model's own template.

The prompt is what `tokenizer.apply_chat_template(..., add_generation_prompt=True)` writes,
tokenized without extra special tokens: the same path the rollout's dataset prompts take, so
a policy sees the same text here as in training.

Two gaps are filled, each the same way every time so that sessions stay token-stable:

* a template that does not mention `tools` (SmolLM2's, for one) gets the tool definitions as
  a system message (`tools_system_text`), asking for `<tool_call>{json}</tool_call>`, the
  format `tool_calls.py` parses; a template without `tool_calls` gets an assistant's earlier
  calls written into its content in that same form;
* a tokenizer with no chat template at all (Flywheel's tiny test model) uses
  `FALLBACK_TEMPLATE`: each message's content on its own line, an assistant's followed by
  the EOS token (what the model emitted to end it), and no generation prompt. It marks no
  roles: it is for test models, not for chat.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.rollout.openai_api.errors import bad_request
from services.rollout.openai_api.schemas import ChatMessage, ToolSpec
from services.rollout.openai_api.tool_calls import CLOSE_TAG, OPEN_TAG, render_call_text

FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' and eos_token %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
)


def tools_system_text(tools: Sequence[ToolSpec]) -> str:
    """The system text that describes `tools` to a template with no tool syntax: the tools
    as JSON, and the call format as a JSON list in `<tool_call>` tags (the form SmolLM2's
    function-calling data uses; `tool_calls.py` also reads a single object)."""
    lines = "\n".join(
        json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools
    )
    return (
        "You can call functions to answer the question. The functions, as JSON:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call one or more of them, answer only with the calls, in this form:\n"
        f'{OPEN_TAG}[{{"name": "function name", "arguments": {{"argument": "value"}}}}]{CLOSE_TAG}'
    )


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    ids: list[int]


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return raw


class ChatRenderer:
    """Renders chat requests for one tokenizer (its template is read once)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        self.template: str = own if isinstance(own, str) and own else FALLBACK_TEMPLATE
        self.native_tools = "tools" in self.template
        self.native_tool_calls = "tool_calls" in self.template

    def _message(self, m: ChatMessage) -> dict[str, Any]:
        role = "system" if m.role == "developer" else m.role
        out: dict[str, Any] = {"role": role, "content": m.text()}
        if m.name is not None:
            out["name"] = m.name
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if self.native_tool_calls:
                out["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _arguments(c.function.arguments),
                        },
                    }
                    for c in m.tool_calls
                ]
            else:
                calls = "\n".join(
                    render_call_text(c.function.name, c.function.arguments) for c in m.tool_calls
                )
                out["content"] = f"{out['content']}\n{calls}" if out["content"] else calls
        return out

    def messages(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The template's inputs: message dicts, and tools when the template takes them."""
        msgs = [self._message(m) for m in messages]
        if not tools:
            return msgs, None
        if self.native_tools:
            return msgs, [t.model_dump(exclude_none=True) for t in tools]
        text = tools_system_text(tools)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{text}"}
        else:
            msgs.insert(0, {"role": "system", "content": text})
        return msgs, None

    def render(
        self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] | None = None
    ) -> RenderedPrompt:
        msgs, tool_dicts = self.messages(messages, tools)
        kwargs: dict[str, Any] = {"tools": tool_dicts} if tool_dicts else {}
        try:
            text = self.tokenizer.apply_chat_template(
                msgs,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=True,
                **kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - jinja raises many kinds for a bad input
            raise bad_request(
                f"the model's chat template cannot render these messages: {exc}",
                param="messages",
            ) from exc
        return RenderedPrompt(text=str(text), ids=self.encode(str(text)))

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
