"""A tool worker process: `python -m services.reward.tools.worker`, driven by `ToolSandbox`.

The reward worker's machinery with tools instead of reward functions: the same frames
(`services.reward.protocol`), the same start-up (protocol on private descriptors, a child
subreaper, SIGKILL when the parent dies), the same limits (RLIMIT_AS for the process,
RLIMIT_CPU re-armed per call) and the same scrubbed environment (`spawn_worker` passes
`worker_environment`). Only the call differs: a tool takes keyword arguments and returns
text, where a reward function returns a float.

Frames after `init`/`ready`:
    service → worker  {"op": "call", "id": int, "tool": path, "arguments": {...}}
    worker → service  {"op": "result", "id": int, "status": "OK"|"ERROR", "content": str,
                       "reason": ""|"memory"|"cpu"|"error", "restart": bool}
A tool's exception is an ERROR result with the message as content (the model reads it);
after a MemoryError or a CPU-limit hit the worker reports and exits, as the reward
worker does, and the sandbox starts a fresh one.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from services.reward import worker as reward_worker
from services.reward.protocol import read_frame_fd, write_frame_fd
from services.reward.registry import load_callable

MAX_CONTENT_CHARS = 8000


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= MAX_CONTENT_CHARS else text[: MAX_CONTENT_CHARS - 3] + "..."


def run_call(msg: dict[str, Any], cpu_seconds: float, memory_bytes: int) -> dict[str, Any]:
    """Run one tool call under the CPU limit; never raises."""
    status, content, reason, restart = "OK", "", "", False
    try:
        reward_worker._arm_cpu_limit(cpu_seconds)
        try:
            fn = load_callable(str(msg["tool"]))
            args = msg.get("arguments") or {}
            if not isinstance(args, dict):
                raise TypeError("tool arguments must be a JSON object")
            content = _text(fn(**args))
        finally:
            reward_worker._disarm_cpu_limit()
    except MemoryError:
        status, reason, restart = "ERROR", "memory", True
        content = f"MemoryError: tool memory limit of {memory_bytes >> 20} MiB reached"
    except reward_worker.CpuLimitExceeded:
        status, reason, restart = "ERROR", "cpu", True
        content = f"CpuLimitExceeded: tool used more than {cpu_seconds:g} CPU seconds"
    except BaseException as exc:  # noqa: BLE001 - a tool may raise anything, even SystemExit
        status, reason, content = "ERROR", "error", reward_worker._describe(exc)
    return {
        "op": "result",
        "id": msg.get("id"),
        "status": status,
        "content": content,
        "reason": reason,
        "restart": restart,
    }


def main() -> int:
    started = reward_worker.begin_worker("tool worker")
    if started is None:
        return 2
    proto_in, proto_out, init = started
    cpu_seconds = float(init.get("cpu_seconds", 0))
    memory_bytes = int(init.get("memory_bytes", 0))
    for path in init.get("preload", []):
        try:
            load_callable(path)
        except Exception as exc:  # noqa: BLE001 - reported per call when it is used
            print(f"tool worker: cannot preload {path}: {exc}", file=sys.stderr)
    reward_worker._apply_memory_limit(memory_bytes)  # after imports: they are ours
    write_frame_fd(proto_out, {"op": "ready", "pid": os.getpid()})
    return _serve(proto_in, proto_out, cpu_seconds, memory_bytes)


def _serve(proto_in: int, proto_out: int, cpu_seconds: float, memory_bytes: int) -> int:
    """Answer call frames until `exit`, end of input, or a call that needs a fresh worker."""
    while (msg := read_frame_fd(proto_in)) is not None and msg["op"] == "call":
        result = run_call(msg, cpu_seconds, memory_bytes)
        write_frame_fd(proto_out, result)
        if result["restart"]:
            return 3
    if msg is not None and msg["op"] != "exit":
        print(f"tool worker: unknown op {msg['op']!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
