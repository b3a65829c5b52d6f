"""Who hears about tool calls: a per-episode listener, set by the agent workflow.

An agent runs its tools itself (through `services.reward.tools.ToolSandbox`), so the
workflow that runs the agent never sees the calls. The sandbox reports each finished call
here and the agent workflow, which sets a listener in the context of each episode's task,
counts them: per episode (the trajectory's `tool_calls`/`tool_failures` metadata, the
tool-call and tool-success rates of a run) and per tool and outcome (Prometheus). A
context variable rather than a global because episodes run concurrently on one loop and
each must count only its own calls; outside an episode nothing listens.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

ToolListener = Callable[[str, str, float], None]
"""`listener(tool, outcome, seconds)`; outcome is `ok`, `error`, `timeout`, `memory`, `cpu`
or `unavailable`."""

_listener: contextvars.ContextVar[ToolListener | None] = contextvars.ContextVar(
    "flywheel_tool_listener", default=None
)


def set_tool_listener(listener: ToolListener | None) -> contextvars.Token[ToolListener | None]:
    """Make `listener` hear the tool calls of this context (and tasks created from it)."""
    return _listener.set(listener)


def report_tool_call(tool: str, outcome: str, seconds: float) -> None:
    """Tell this context's listener, if any, about one finished tool call."""
    listener = _listener.get()
    if listener is not None:
        listener(tool, outcome, seconds)


__all__ = ["ToolListener", "report_tool_call", "set_tool_listener"]
