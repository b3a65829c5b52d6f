"""One worker process as the service sees it: start it, talk to it, kill it.

The service reads the worker's stdout through an asyncio protocol that cuts the bytes
into frames as they arrive (`FrameParser`), so results that arrive together cost one
wake-up. Killing stops the worker, SIGKILLs everything it started (in any session or
process group: the worker is a child subreaper, see `services.reward.reaper`), then its
process group, then reaps it; a service that is a subreaper itself (`enable_subreaper`)
also kills and reaps what a worker that died on its own left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.reward import reaper
from services.reward.protocol import FrameParser, ProtocolError, encode_frame

log = logging.getLogger(__name__)

PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
ORPHAN_REAP_TIMEOUT_S = 5.0

_subreaper = False
_live_workers: set[int] = set()  # spawned and not yet reaped: never an orphan to collect
_spawning = 0  # spawns between fork and registration: collection waits for them


def enable_subreaper() -> bool:
    """Make this process the subreaper of its workers' orphans and collect them after each
    worker's death (`collect_orphans`). Only for a process whose children are all
    reward workers (`python -m services.reward`): any other child would count as an
    orphan and be killed. False where Linux's prctl is not available."""
    global _subreaper
    _subreaper = reaper.become_subreaper()
    return _subreaper


async def collect_orphans(killed: set[tuple[int, int]] | None = None) -> int:
    """Kill and reap this process's children that are not live workers (what a dead worker
    left behind, adopted as its subreaper); returns how many were killed now (`killed`,
    updated, holds those killed before). A no-op unless `enable_subreaper` succeeded."""
    if not _subreaper:
        return 0
    killed = killed if killed is not None else set()
    before = len(killed)
    deadline = time.monotonic() + ORPHAN_REAP_TIMEOUT_S
    while True:
        # A worker between fork and registration would look like an orphan: wait for it.
        if not _spawning and reaper.reap_orphans(_live_workers, killed) == 0:
            return len(killed) - before
        if time.monotonic() > deadline:
            log.warning("orphans of a reward worker not reaped yet", extra={"killed": len(killed)})
            return len(killed) - before
        await asyncio.sleep(0.01)


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
        self.on_gone: Callable[[], None] | None = None  # the pool's wake-up for an idle slot

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
            if self.on_gone is not None:
                self.on_gone()

    def process_exited(self) -> None:
        self.closed = True
        self._wake()
        if not self.exited.done():
            self.exited.set_result(None)
        if self.on_gone is not None:
            self.on_gone()

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
        info = reaper.read_proc(self.pid)
        self.start_time = info.start if info is not None else None
        self.descendants_killed = 0  # processes its functions started, killed with it
        self._killed: set[tuple[int, int]] = set()  # the same, by (pid, start time)
        stdin = transport.get_pipe_transport(0)
        assert isinstance(stdin, asyncio.WriteTransport)
        self.stdin = stdin
        _live_workers.add(self.pid)
        protocol.exited.add_done_callback(lambda _: _live_workers.discard(self.pid))

    @property
    def gone(self) -> bool:
        """The worker exited or closed its output: it can score nothing more."""
        return self.protocol.closed

    def send(self, frame: bytes) -> None:
        """Queue a frame on the worker's stdin (the transport writes it as the pipe drains)."""
        self.stdin.write(frame)

    def has_frame(self) -> bool:
        return bool(self.protocol.frames)

    async def recv(self) -> dict[str, Any]:
        return await self.protocol.next_frame()

    def send_kill(self) -> None:
        """Kill the worker and everything its functions started; reaping can follow.

        SIGSTOP to its process group first (the function can start nothing more), then
        SIGKILL to every descendant, whatever session or group it moved to (they are all
        below the worker: it is their subreaper), then SIGKILL to the group, which the
        worker leads (a session leader cannot leave its group).

        Not `transport.kill()`: Popen.send_signal polls first, and a poll that finds the
        worker already exited reaps it in this thread, under the child watcher that
        waits for it; the watcher then reports exit status 255 instead of the real one."""
        if self.transport.get_returncode() is None:  # not reaped: the pid is still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGSTOP)
            self.descendants_killed += reaper.kill_descendants(
                self.pid, self.start_time, self._killed
            )
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    async def wait(self) -> int | None:
        """Reap the worker, then (in a subreaper service) what it left behind."""
        await self.protocol.exited
        code = self.transport.get_returncode()
        self.transport.close()
        self.descendants_killed += await collect_orphans(self._killed)
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
    module: str = "services.reward.worker",
) -> WorkerProcess:
    """Start `python -m <module>` (the reward worker, or the tool worker of
    `services.reward.tools`: same frames, same limits), send its init frame, wait until ready.

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
    global _spawning
    _spawning += 1
    try:
        transport, protocol = await asyncio.get_running_loop().subprocess_exec(
            _WorkerProtocol,
            sys.executable,
            "-m",
            module,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            start_new_session=True,
            env=env,
            cwd=PROJECT_ROOT,
        )
        worker = WorkerProcess(transport, protocol)
    finally:
        _spawning -= 1
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
