"""One worker process as the service sees it: start it, talk to it, kill it.

The service reads the worker's stdout through an asyncio protocol that cuts the bytes
into frames as they arrive (`FrameParser`), so results that arrive together cost one
wake-up. Killing is SIGKILL to the worker's process group, then reaping.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

from services.reward.protocol import FrameParser, ProtocolError, encode_frame

PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


class WorkerGone(Exception):
    """The worker's output pipe closed (it exited or was killed)."""


class _WorkerProtocol(asyncio.SubprocessProtocol):
    """Collects result frames from the worker's stdout as they arrive."""

    def __init__(self) -> None:
        self.parser = FrameParser()
        self.frames: deque[dict[str, Any]] = deque()
        self.error: Exception | None = None
        self.closed = False
        self._waiter: asyncio.Future[None] | None = None
        self.exited: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if fd != 1 or self.error is not None:
            return
        try:
            self.frames.extend(self.parser.feed(data))
        except ProtocolError as exc:
            self.error = exc
        self._wake()

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 1:
            self.closed = True
            self._wake()

    def process_exited(self) -> None:
        self.closed = True
        self._wake()
        if not self.exited.done():
            self.exited.set_result(None)

    async def next_frame(self) -> dict[str, Any]:
        while not self.frames:
            if self.error is not None:
                raise self.error
            if self.closed:
                raise WorkerGone()
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self.frames.popleft()


class WorkerProcess:
    """One live worker: its process, its pipes, and how to kill it."""

    def __init__(self, transport: asyncio.SubprocessTransport, protocol: _WorkerProtocol) -> None:
        self.transport = transport
        self.protocol = protocol
        self.pid: int = transport.get_pid()
        stdin = transport.get_pipe_transport(0)
        assert isinstance(stdin, asyncio.WriteTransport)
        self.stdin = stdin

    def send(self, frame: bytes) -> None:
        """Queue a frame on the worker's stdin (the transport writes it as the pipe drains)."""
        self.stdin.write(frame)

    def has_frame(self) -> bool:
        return bool(self.protocol.frames)

    async def recv(self) -> dict[str, Any]:
        return await self.protocol.next_frame()

    def send_kill(self) -> None:
        """SIGKILL the worker's process group (it leads its own session): the function,
        and anything it forked, stop now; reaping can follow."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.transport.kill()

    async def wait(self) -> int | None:
        await self.protocol.exited
        code = self.transport.get_returncode()
        self.transport.close()
        return code

    async def kill(self) -> int | None:
        """SIGKILL, then reap; returns the exit status."""
        self.send_kill()
        return await self.wait()


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


CREDENTIAL_MARKERS = ("TOKEN", "PASSWORD", "SECRET", "CREDENTIAL", "API_KEY", "TLS_KEY")
"""A `FLYWHEEL_*` variable whose name holds one of these is a credential (the services'
bearer tokens, the Redis password, the TLS private key's path)."""

CREDENTIAL_VARIABLES = frozenset({"REDIS_PASSWORD", "REDISCLI_AUTH", "SGLANG_API_KEY"})
"""Credentials of the services around Flywheel that a reward worker has no use for."""


def worker_environment(environ: dict[str, str]) -> dict[str, str]:
    """`environ` without Flywheel's credentials: user reward code runs with none of them, so
    a reward function cannot call the buffer, the trainer or Redis as the service could."""
    return {
        name: value
        for name, value in environ.items()
        if name not in CREDENTIAL_VARIABLES
        and not (name.startswith("FLYWHEEL_") and any(m in name for m in CREDENTIAL_MARKERS))
    }


async def spawn_worker(
    *,
    memory_bytes: int,
    cpu_seconds: float,
    preload: tuple[str, ...] = (),
    warmup: tuple[str, ...] = (),
    start_timeout_s: float = 120.0,
) -> WorkerProcess:
    """Start `python -m services.reward.worker`, send its init frame, wait until ready.

    The worker leads its own session (so a kill reaches everything it forked), imports the
    project from PROJECT_ROOT whatever the service's cwd, and sees the service's sys.path
    (user functions importable here are importable there), but none of its credentials
    (`worker_environment`)."""
    env = worker_environment(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join(
        [PROJECT_ROOT, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    # Few malloc arenas: each one reserves address space, which RLIMIT_AS counts.
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env["FLYWHEEL_REWARD_SERVICE_PID"] = str(os.getpid())  # see worker._die_with_parent
    transport, protocol = await asyncio.get_running_loop().subprocess_exec(
        _WorkerProtocol,
        sys.executable,
        "-m",
        "services.reward.worker",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None,
        start_new_session=True,
        env=env,
        cwd=PROJECT_ROOT,
    )
    worker = WorkerProcess(transport, protocol)
    try:
        worker.send(
            encode_frame(
                {
                    "op": "init",
                    "memory_bytes": memory_bytes,
                    "cpu_seconds": cpu_seconds,
                    "sys_path": [p for p in sys.path if p],
                    "preload": list(preload),
                    "warmup": list(warmup),
                }
            )
        )
        async with asyncio.timeout(start_timeout_s):
            ready = await worker.recv()
        if ready.get("op") != "ready":
            raise ProtocolError(f"expected 'ready', got {ready.get('op')!r}")
    except asyncio.CancelledError:
        await worker.kill()
        raise
    except Exception as exc:
        code = await worker.kill()
        raise RuntimeError(
            f"worker {worker.pid} did not start ({describe_exit(code)}; {type(exc).__name__})"
        ) from None
    return worker
