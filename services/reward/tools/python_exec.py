"""The `python` tool: run a snippet and return what it printed.

This runs arbitrary code on purpose, so it only ever runs inside a tool worker
(`services.reward.tools.worker`): its own process, killed at the call's deadline, under
the worker's memory and CPU limits and with none of Flywheel's credentials in its
environment. Each call gets fresh globals; the value of a final bare expression is
printed as the interactive interpreter would.
"""

from __future__ import annotations

import ast
import contextlib
import io
from typing import Any

from services.reward.tools.schemas import one_argument_tool

MAX_OUTPUT_CHARS = 4000

SCHEMA = one_argument_tool(
    "python", "Run Python code and return what it prints.", "code", "Python source."
)
"""The OpenAI `tools` entry an agent offers the model for this tool."""


def python(code: str) -> str:
    """Run `code`; its stdout (and the repr of a last bare expression), truncated."""
    tree = ast.parse(str(code), mode="exec")
    tail: ast.Expression | None = None
    last = tree.body[-1] if tree.body else None
    if isinstance(last, ast.Expr):
        tree.body.pop()
        tail = ast.Expression(last.value)
    scope: dict[str, Any] = {"__name__": "__tool__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(tree, "<tool>", "exec"), scope)  # noqa: S102 - the sandbox's purpose
        if tail is not None:
            value = eval(compile(tail, "<tool>", "eval"), scope)  # noqa: S307 - as above
            if value is not None:
                print(repr(value))
    text = out.getvalue()
    return text if len(text) <= MAX_OUTPUT_CHARS else text[: MAX_OUTPUT_CHARS - 3] + "..."
