"""A user workflow, loaded by dotted path in the tests (as a user's own module would be)."""

from __future__ import annotations

from typing import Any


class EchoWorkflow:
    def __init__(self, ctx: Any, *, tag: str) -> None:
        self.ctx = ctx
        self.tag = tag

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> None:
        return None


class NotAWorkflow:
    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
