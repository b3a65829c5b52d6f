"""Worker pool internals (`services/reward/pool.py`) with real worker processes: the rest
of a chunk survives a timeout, the per-call CPU limit, the atomic queue bound, close().
Also: what a function starts in other sessions dies with its worker, a worker killed while
idle is replaced at once, and readiness changes are reported.
(The faults as a user meets them, through gRPC, are in test_servicer.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

from services.reward.metrics import RewardMetrics
from services.reward.pool import (
    PoolClosedError,
    PoolConfig,
    PoolFullError,
    ScoreTask,
    WorkerPool,
)
from tests.reward.conftest import process_identity, read_started, wait_gone

pytestmark = pytest.mark.integration

ARITH = "services.reward.builtins:arithmetic_reward"
FAULTY = "tests.reward.faulty"


def task(
    fn: str = ARITH,
    completion: str = "#### 4",
    answer: str = "4",
    deadline_s: float = 30.0,
    **kwargs: object,
) -> ScoreTask:
    payload = {
        "prompt": "2+2=",
        "completion": completion,
        "prompt_ids": [1],
        "completion_ids": [2, 3],
        "answer": answer,
        "kwargs": kwargs,
    }
    return ScoreTask(fn.rsplit(":", 1)[-1], fn, payload, deadline_s)


async def started(**overrides: object) -> tuple[WorkerPool, RewardMetrics]:
    metrics = RewardMetrics()
    config = {"num_workers": 1, "memory_bytes": 1 << 30, "cpu_seconds": 0.0, "preload": (ARITH,)}
    config.update(overrides)
    pool = WorkerPool(PoolConfig(**config), metrics)  # type: ignore[arg-type]
    await pool.start()
    return pool, metrics


async def test_timeout_mid_chunk_requeues_the_rest_on_a_fresh_worker() -> None:
    pool, metrics = await started(max_chunk=8)
    try:
        [first_pid] = pool.worker_pids()
        first = process_identity(first_pid)
        tasks = [
            task(completion="#### 4"),
            task(f"{FAULTY}:sleeps", deadline_s=1.0),
            task(completion="#### 5"),
            task(completion="4"),
        ]
        results = await pool.score(tasks)  # one worker: all four go in one chunk
        assert [r.status for r in results] == ["OK", "TIMEOUT", "OK", "OK"]
        assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0]
        assert "killed and replaced" in results[1].message
        assert first is not None and process_identity(first_pid) != first  # killed
        assert [process_identity(p) for p in pool.worker_pids()] != [first]  # and replaced
        assert metrics.worker_restarts.labels(reason="timeout")._value.get() == 1
    finally:
        await pool.close()


async def test_cpu_limit_stops_a_function_that_swallows_exceptions() -> None:
    # `swallows_everything` catches Exception around its busy loop; the CPU limit raises a
    # BaseException, so it still ends as ERROR long before the 60 s wall deadline.
    pool, metrics = await started(cpu_seconds=1.0)
    try:
        [res] = await pool.score([task(f"{FAULTY}:swallows_everything", deadline_s=60.0)])
        assert res.status == "ERROR"
        assert res.message.startswith("CpuLimitExceeded")
        assert metrics.worker_restarts.labels(reason="cpu")._value.get() == 1
        [after] = await pool.score([task()])
        assert after.status == "OK" and after.reward == 1.0
    finally:
        await pool.close()


async def test_queue_bound_takes_all_or_nothing() -> None:
    pool, _ = await started(max_queue=4)
    try:
        blocker = task(f"{FAULTY}:sleeps", deadline_s=30.0, seconds=0.5)
        pool.submit([blocker])
        async with asyncio.timeout(60):  # the worker takes it; the queue is empty again
            while pool.queued:
                await asyncio.sleep(0.01)
        with pytest.raises(PoolFullError, match="5 items asked, 4 free"):
            pool.submit([task() for _ in range(5)])
        assert pool.queued == 0  # nothing of the refused request was queued
        four = [task() for _ in range(4)]
        pool.submit(four)
        results = await asyncio.gather(*(t.future for t in four))
        assert [r.reward for r in results] == [1.0] * 4
        assert (await blocker.future).status == "OK"
    finally:
        await pool.close()


async def test_close_fails_what_is_pending() -> None:
    pool, _ = await started()
    pending = [task(f"{FAULTY}:sleeps", deadline_s=30.0), task()]
    pool.submit(pending)
    await asyncio.sleep(0.1)
    await pool.close()
    for t in pending:
        with pytest.raises(PoolClosedError):
            await t.future
    with pytest.raises(PoolClosedError):
        pool.submit([task()])


async def test_print_from_a_function_does_not_break_the_protocol() -> None:
    pool, _ = await started()
    try:
        results = await pool.score([task(f"{FAULTY}:prints_and_scores") for _ in range(3)])
        assert [r.reward for r in results] == [2.0] * 3  # len(completion_ids) = 2
    finally:
        await pool.close()


def kill_if_alive(identities: list[tuple[int, int]]) -> None:
    """Cleanup after a failed assertion: no `sleep 600` outlives the test."""
    for pid, start in identities:
        if process_identity(pid) == (pid, start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_deadline_kills_what_the_function_started_in_other_sessions(
    tmp_path: Path,
) -> None:
    # A regression: the deadline's kill of the worker's process group missed helpers that a
    # function put in a session of their own, and orphans a shell left behind.
    pool, metrics = await started()
    pid_file = tmp_path / "pids"
    helpers: list[tuple[int, int]] = []
    try:
        [worker_pid] = pool.worker_pids()
        [res] = await pool.score(
            # The deadline must outlast two process starts on a loaded machine: the pid
            # file is written only after both helpers run.
            [task(f"{FAULTY}:starts_helpers", deadline_s=20.0, pid_file=str(pid_file))]
        )
        assert res.status == "TIMEOUT"
        own, orphan, worker = read_started(pid_file)
        helpers = [own.identity, orphan.identity]
        assert worker.pid == worker_pid and worker.sid == worker_pid  # it leads its session
        # Out of the process-group kill's reach: each in a session that is not the worker's.
        assert own.sid == own.pid and orphan.sid not in (worker_pid, own.sid)
        # The orphan was adopted by the worker (its subreaper), not by init: findable.
        assert orphan.ppid == worker_pid
        assert await asyncio.to_thread(wait_gone, [*helpers, worker.identity]) == []
        assert metrics.descendants_killed._value.get() == 2
        [after] = await pool.score([task()])  # a fresh worker scores
        assert (after.status, after.reward) == ("OK", 1.0)
    finally:
        await pool.close()
        kill_if_alive(helpers)


async def test_a_worker_killed_while_idle_is_replaced_and_readiness_follows() -> None:
    changes: list[bool] = []
    metrics = RewardMetrics()
    pool = WorkerPool(
        PoolConfig(num_workers=1, memory_bytes=1 << 30, cpu_seconds=0.0, preload=(ARITH,)),
        metrics,
    )
    pool.on_ready_change = changes.append
    await pool.start()
    try:
        [first_pid] = pool.worker_pids()
        first = process_identity(first_pid)
        assert changes == [True]
        os.kill(first_pid, signal.SIGKILL)  # as the OOM killer would, with no item running
        async with asyncio.timeout(60):
            while changes != [True, False, True]:  # taken out at once, then replaced
                await asyncio.sleep(0.02)
        [second_pid] = pool.worker_pids()
        assert process_identity(second_pid) != first
        assert metrics.worker_restarts.labels(reason="crash")._value.get() == 1
        [res] = await pool.score([task()])
        assert (res.status, res.reward) == ("OK", 1.0)
    finally:
        await pool.close()
    assert changes[-1] is False  # closed: no worker
