"""One worker process (`services/reward/process.py`): start, score, kill, fail to start."""

from __future__ import annotations

import signal

import pytest

from services.reward.process import WorkerGone, describe_exit, spawn_worker
from services.reward.protocol import encode_frame
from tests.reward.conftest import process_identity

pytestmark = pytest.mark.integration

ARITH = "services.reward.builtins:arithmetic_reward"


def score_frame(*completions: str) -> bytes:
    items = [
        {
            "id": i,
            "fn": ARITH,
            "prompt": "1+2=",
            "completion": c,
            "prompt_ids": [],
            "completion_ids": [],
            "answer": "#### 3",
            "kwargs": {},
        }
        for i, c in enumerate(completions)
    ]
    return encode_frame({"op": "score", "items": items})


async def test_worker_scores_a_chunk_in_order_then_dies_when_killed() -> None:
    worker = await spawn_worker(memory_bytes=1 << 30, cpu_seconds=0, preload=(ARITH,))
    identity = process_identity(worker.pid)
    assert identity is not None
    try:
        worker.send(score_frame("#### 3", "#### 4", "3"))
        results = [await worker.recv() for _ in range(3)]
        assert [(r["id"], r["status"], r["reward"]) for r in results] == [
            (0, "OK", 1.0),
            (1, "OK", 0.0),
            (2, "OK", 1.0),
        ]
        # Each item ends before the next starts: the clocks the deadlines rely on.
        assert results[0]["t1"] <= results[1]["t0"] <= results[1]["t1"] <= results[2]["t0"]
    finally:
        code = await worker.kill()
    assert code == -signal.SIGKILL
    assert describe_exit(code) == "killed by SIGKILL"
    with pytest.raises(WorkerGone):
        await worker.recv()
    assert process_identity(worker.pid) != identity  # gone (its pid may be reused already)


async def test_a_worker_that_cannot_start_in_time_is_killed_and_reported() -> None:
    with pytest.raises(RuntimeError, match=r"did not start \(killed by SIGKILL; TimeoutError\)"):
        await spawn_worker(memory_bytes=0, cpu_seconds=0, start_timeout_s=0.001)


def test_describe_exit() -> None:
    assert describe_exit(7) == "exit code 7"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(None) == "still running"


async def test_user_reward_code_sees_no_flywheel_credential(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 24: the worker inherited FLYWHEEL_TOKEN (and whatever the service had).
    secrets = {
        "FLYWHEEL_TOKEN": "tok-shared-1",
        "FLYWHEEL_TOKEN_TRAINER": "tok-trainer-2",
        "FLYWHEEL_REDIS_PASSWORD": "redis-pw-3",
        "FLYWHEEL_CREDENTIALS": "creds-4",
        "FLYWHEEL_TLS_KEY": "/etc/flywheel/tls/tls.key-5",
        "REDIS_PASSWORD": "redis-pw-6",
    }
    for name, value in {**secrets, "FLYWHEEL_HARMLESS": "visible-7"}.items():
        monkeypatch.setenv(name, value)
    probe = "tests.reward.env_probe:sees"
    worker = await spawn_worker(memory_bytes=1 << 30, cpu_seconds=0, preload=(probe,))
    try:
        answers = [*secrets.values(), "visible-7"]
        items = [
            {
                "id": i,
                "fn": probe,
                "prompt": "",
                "completion": "",
                "prompt_ids": [],
                "completion_ids": [],
                "answer": a,
                "kwargs": {},
            }
            for i, a in enumerate(answers)
        ]
        worker.send(encode_frame({"op": "score", "items": items}))
        results = [await worker.recv() for _ in answers]
    finally:
        await worker.kill()
    # Every credential is gone; the control variable shows the probe does see the env.
    assert [(r["status"], r["reward"]) for r in results] == [("OK", 0.0)] * len(secrets) + [
        ("OK", 1.0)
    ]
