"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Field names and meanings are the OpenAI API's (Chat Completions, Completions, Models).
Every list, string and number has a bound, so a request is refused with a 400 before it can
cost memory or time; unknown top-level fields are ignored, as OpenAI-compatible servers do
(clients send `user`, `metadata`, `stream_options`, ...). Requests are validated here;
what depends on the served model (context length, model name) is checked in the routes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_MESSAGES = 512
MAX_TOOLS = 128
MAX_N = 16
MAX_STOP = 4
MAX_TEXT_CHARS = 1 << 20  # one message's text
MAX_NEW_TOKENS = 1 << 20
MAX_SEED = (1 << 62) - 1  # sample i of n uses seed + i; torch seeds are 64-bit

_LENIENT = ConfigDict(extra="ignore")
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
StopText = Annotated[str, Field(min_length=1, max_length=256)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]


class TextPart(BaseModel):
    """A text part of a message's content list (images and audio are not served)."""

    model_config = _LENIENT
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class FunctionCall(BaseModel):
    model_config = _LENIENT
    name: str = Field(max_length=256)
    arguments: str = Field(default="{}", max_length=MAX_TEXT_CHARS)
    """The arguments as a JSON string, exactly as OpenAI sends them."""


class ToolCall(BaseModel):
    model_config = _LENIENT
    id: str = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of the conversation; `tool` messages answer a `tool_call_id`."""

    model_config = _LENIENT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionSpec(BaseModel):
    model_config = _LENIENT
    name: str = Field(min_length=1, max_length=256)
    description: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = _LENIENT
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = _LENIENT
    name: str = Field(max_length=256)


class NamedToolChoice(BaseModel):
    model_config = _LENIENT
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = _LENIENT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling fields chat and text completions share."""

    model_config = _LENIENT
    model: str = Field(max_length=512)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[ToolSpec] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: a text prompt or one prompt's token ids."""

    prompt: Text | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TEXT_CHARS)]
    max_tokens: int = Field(default=16, ge=1, le=MAX_NEW_TOKENS)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: Literal[False] = False
    """Echoing the prompt back is not served (`false` only)."""


class SessionInfo(BaseModel):
    """`POST /sessions`: the new session and the base URL to give an OpenAI client."""

    id: str
    base_url: str


class CallSummary(BaseModel):
    """One recorded call of a session, token for token."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    drift: bool
    reused_prefix_tokens: int


class SessionRecord(BaseModel):
    """`GET /sessions/{id}`: every call recorded so far and the turns that drifted."""

    id: str
    closed: bool
    drift_turns: list[int]
    calls: list[CallSummary]
