"""`ToolSandbox`: run an agent's tool calls in worker processes, each under a deadline.

Why out of process: a tool runs what the model wrote (a Python snippet, an expression).
Only a process can be killed mid-loop and only a process has its own limits, so tools get
the reward service's worker machinery (`services.reward.process`): a worker leading its
own session with RLIMIT_AS and a per-call RLIMIT_CPU, an environment without Flywheel's
credentials, and a kill that takes everything the tool started with it.

Why a library and not a reward-service RPC: a tool call sits inside an episode between two
model calls, so its latency is the agent's latency; a hop to the reward service would
queue it behind scoring and make every agent depend on that service being up. The
sandbox lives in the process that runs the agent (the rollout replica, or a user's own
process) and starts its workers lazily, at most `num_workers` at a time.

Every call returns a `ToolResult`, never raises for what the tool did: a deadline passed
(`timeout`: the worker is killed and replaced), memory or CPU exhausted (`memory`, `cpu`:
the worker exits and is replaced), the tool raised (`error`: the worker stays). Each
finished call is reported to the episode's listener (`services.core.tool_events`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.core.tool_events import report_tool_call
from services.reward.process import WorkerGone, WorkerProcess, describe_exit, spawn_worker
from services.reward.protocol import ProtocolError, encode_frame

log = logging.getLogger(__name__)

WORKER_MODULE = "services.reward.tools.worker"

BUILTIN_TOOLS = {
    "calculator": "services.reward.tools.calculator:calculator",
    "python": "services.reward.tools.python_exec:python",
}
"""Tools by the name a model calls them; anything else is named by dotted path."""


@dataclass(frozen=True)
class ToolResult:
    """One finished call: `content` is what the model is shown."""

    ok: bool
    content: str
    outcome: str  # ok | error | timeout | memory | cpu | unavailable
    seconds: float


@dataclass(frozen=True)
class SandboxConfig:
    deadline_s: float = 5.0
    """Wall-clock limit of one call; the worker is SIGKILLed when it passes."""
    memory_bytes: int = 512 << 20
    """RLIMIT_AS of a worker (address space: the interpreter itself takes ~30 MiB)."""
    cpu_seconds: float = 5.0
    """RLIMIT_CPU of one call; 0 for none."""
    num_workers: int = 2
    """Workers at most, each running one call at a time."""
    start_timeout_s: float = 60.0


class ToolSandbox:
    """A lazily started set of tool workers; `await sandbox.call(name, arguments)`."""

    def __init__(
        self,
        config: SandboxConfig | None = None,
        *,
        tools: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config or SandboxConfig()
        if self.config.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.config.num_workers}")
        self.tools = dict(BUILTIN_TOOLS if tools is None else tools)
        self._idle: list[WorkerProcess] = []
        self._slots = asyncio.Semaphore(self.config.num_workers)
        self._next_id = 0
        self._closed = False

    def resolve(self, name: str) -> str | None:
        """The dotted path of tool `name`, or None when the sandbox does not offer it."""
        return self.tools.get(name)

    async def call(
        self, name: str, arguments: Mapping[str, Any], *, deadline_s: float | None = None
    ) -> ToolResult:
        """Run tool `name` with `arguments` (a JSON object) in a worker; never raises for
        what the tool does. Unknown tools are an `error` result the model can read."""
        t0 = time.monotonic()
        path = self.resolve(name)
        if path is None:
            result = ToolResult(False, f"unknown tool {name!r}", "error", 0.0)
        else:
            async with self._slots:
                result = await self._run(path, dict(arguments), deadline_s, t0)
        # The name comes from the policy: unknown ones share one label.
        report_tool_call(name if path is not None else "unknown", result.outcome, result.seconds)
        return result

    async def _run(
        self, path: str, arguments: dict[str, Any], deadline_s: float | None, t0: float
    ) -> ToolResult:
        if self._closed:
            return ToolResult(False, "tool sandbox is closed", "unavailable", 0.0)
        try:
            worker = self._idle.pop() if self._idle else await self._spawn()
        except Exception as exc:  # noqa: BLE001 - no worker: the call fails, the episode goes on
            log.warning("tool worker did not start", extra={"error": str(exc)})
            return ToolResult(False, "tool sandbox unavailable", "unavailable", 0.0)
        self._next_id += 1
        deadline = self.config.deadline_s if deadline_s is None else deadline_s
        try:
            worker.send(
                encode_frame(
                    {"op": "call", "id": self._next_id, "tool": path, "arguments": arguments}
                )
            )
            async with asyncio.timeout(deadline):
                reply = await worker.recv()
        except TimeoutError:
            await worker.kill()
            return ToolResult(
                False, f"tool timed out after {deadline:g} s", "timeout", time.monotonic() - t0
            )
        except (WorkerGone, ProtocolError, ValueError) as exc:
            code = await worker.kill()
            message = f"tool worker died ({describe_exit(code)})"
            if isinstance(exc, ValueError):  # arguments that are not JSON
                message = f"tool arguments not serialisable: {exc}"
            return ToolResult(False, message, "error", time.monotonic() - t0)
        except BaseException:
            await worker.kill()  # cancelled mid-call: the worker's state is unknown
            raise
        seconds = time.monotonic() - t0
        if reply.get("restart"):
            await worker.wait()
        else:
            self._idle.append(worker)
        ok = reply.get("status") == "OK"
        outcome = "ok" if ok else str(reply.get("reason") or "error")
        return ToolResult(ok, str(reply.get("content", "")), outcome, seconds)

    async def _spawn(self) -> WorkerProcess:
        return await spawn_worker(
            memory_bytes=self.config.memory_bytes,
            cpu_seconds=self.config.cpu_seconds,
            preload=tuple(sorted(set(self.tools.values()))),
            start_timeout_s=self.config.start_timeout_s,
            module=WORKER_MODULE,
        )

    async def close(self) -> None:
        """Kill the idle workers; calls after this are `unavailable`."""
        self._closed = True
        idle, self._idle = self._idle, []
        for worker in idle:
            with contextlib.suppress(Exception):
                await worker.kill()
