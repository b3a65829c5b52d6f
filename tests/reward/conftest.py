"""A real reward service on loopback, running its own event loop in a thread.

The service lives in a thread so that tests can talk to it with blocking stubs, with the
async client on their own loop, or several clients at once, exactly as separate processes
would; its pool's worker processes are real (`python -m services.reward.worker`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from flywheel_proto.v1 import reward_pb2_grpc
from services.common.config import RewardConfig
from services.common.grpc_client import make_sync_channel
from services.reward.service import RewardParts, RewardService

T = TypeVar("T")

FAULTY = "tests.reward.faulty"


class RunningReward:
    """`RewardService` started on a private loop thread; `stop()` drains and joins."""

    def __init__(
        self, config: RewardConfig, *, metrics: bool = False, auth_token: str | None = None
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name="reward-loop"
        )
        self._thread.start()

        async def build() -> RewardService:
            svc = RewardService(
                RewardParts(
                    reward=config, metrics_port=0 if metrics else None, auth_token=auth_token
                )
            )
            await svc.start()
            return svc

        self.service: RewardService = self.run(build(), timeout=180)
        self.address = self.service.address
        self.channel = make_sync_channel(self.address, auth_token=auth_token)
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def worker_pids(self) -> list[int]:
        async def pids() -> list[int]:
            return self.service.pool.worker_pids()

        return self.run(pids())

    def wait_workers(self, n: int, timeout: float = 120) -> list[int]:
        """Block until `n` workers are ready (after a kill, the replacement is starting)."""

        async def wait() -> list[int]:
            while self.service.pool.ready_workers < n:
                await asyncio.sleep(0.02)
            return self.service.pool.worker_pids()

        return self.run(wait(), timeout)

    def identities(self, n: int) -> set[tuple[int, int]]:
        """`process_identity` of each worker, once `n` are ready."""
        found = {process_identity(pid) for pid in self.wait_workers(n)}
        return {ident for ident in found if ident is not None}

    def stop(self) -> None:
        self.channel.close()
        self.run(self.service.stop(grace=2.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def process_identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time since boot in clock ticks), or None when no such process runs.

    "Is the killed worker gone?" cannot be asked with the pid alone: pids wrap (pid_max is
    32768 on small machines) and a busy machine hands a freed pid out again within seconds.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie is dead, only not reaped yet
        return None
    return pid, int(fields[19])  # field 22 of proc(5): starttime


@dataclass(frozen=True)
class Started:
    """A process `faulty.starts_helpers` reported: who it is and where it was."""

    pid: int
    start: int
    ppid: int
    sid: int

    @property
    def identity(self) -> tuple[int, int]:
        return self.pid, self.start


def read_started(path: Path) -> tuple[Started, Started, Started]:
    """The own-session helper, the orphaned helper and the worker, as the function wrote
    them to `path`."""
    own, orphan, worker = (
        Started(*map(int, line.split())) for line in path.read_text().splitlines()
    )
    return own, orphan, worker


def wait_gone(identities: list[tuple[int, int]], timeout: float = 30.0) -> list[tuple[int, int]]:
    """Wait (bounded) until none of these processes runs; returns those still running.
    SIGKILL takes effect when the kernel next schedules the process, not at once."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [i for i in identities if process_identity(i[0]) == i]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def service_config(**overrides: Any) -> RewardConfig:
    """The test service: gsm8k by default, the misbehaving functions registered by name."""
    base: dict[str, Any] = {
        "fn": "gsm8k",
        "num_workers": 2,
        "deadline_ms": 5000,
        "worker_memory_mb": 512,
        "max_batch": 64,
        "max_queue": 512,
        "cache": False,
        "functions": {
            name: f"{FAULTY}:{name}"
            for name in (
                "raises",
                "loops_forever",
                "sleeps",
                "allocates_forever",
                "exits_process",
                "returns_nan",
                "returns_text",
                "prints_and_scores",
                "echo_kwargs",
                "refuses_answer",
            )
        },
    }
    base.update(overrides)
    return RewardConfig(**base)


@pytest.fixture(scope="module")
def reward_service() -> Iterator[RunningReward]:
    """One real service per test module (worker start-up is the slow part)."""
    svc = RunningReward(service_config())
    try:
        yield svc
    finally:
        svc.stop()


def rpc_code(exc: grpc.RpcError) -> grpc.StatusCode:
    return exc.code()  # type: ignore[no-any-return]
