"""One worker process (`services/reward/process.py`): start, score, kill, fail to start;
in a subreaper service, what a worker that died on its own had started is killed too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.reward.process import PROJECT_ROOT, WorkerGone, describe_exit, spawn_worker
from services.reward.protocol import encode_frame
from tests.reward.conftest import process_identity, read_started, wait_gone

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
    # A regression: the worker inherited FLYWHEEL_TOKEN (and whatever the service had).
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


# Runs in a process of its own: becoming a subreaper changes who adopts orphans for the
# whole process, which a pytest process shared with other tests must not do.
_DIES_ON_ITS_OWN = """
import asyncio, json, sys
from services.reward import process
from services.reward.protocol import encode_frame

FN = "tests.reward.faulty:starts_helpers"

async def main():
    subreaper = process.enable_subreaper() if sys.argv[2] == "subreaper" else False
    worker = await process.spawn_worker(memory_bytes=0, cpu_seconds=0, preload=(FN,))
    item = {"id": 0, "fn": FN, "prompt": "", "completion": "", "prompt_ids": [],
            "completion_ids": [], "answer": "", "kwargs": {"pid_file": sys.argv[1], "then": "exit"}}
    worker.send(encode_frame({"op": "score", "items": [item]}))
    # wait(), not kill(): no tree kill runs, only the collection of orphans after reaping.
    code = await worker.wait()
    print(json.dumps({"subreaper": subreaper, "code": code, "killed": worker.descendants_killed}))

asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["subreaper", "plain"])
def test_a_subreaper_service_kills_what_a_dead_worker_left(tmp_path: Path, mode: str) -> None:
    # The worker exits by itself (os._exit(5)) after starting two helpers in sessions of
    # their own; by the time the worker is reaped, they are re-parented: to the service
    # when it is a subreaper, which kills and reaps them; otherwise to init (or whichever
    # subreaper is above), out of the service's reach: the control case shows they survive.
    pid_file = tmp_path / "pids"
    done = subprocess.run(
        [sys.executable, "-c", _DIES_ON_ITS_OWN, str(pid_file), mode],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    own, orphan, worker = read_started(pid_file)
    helpers = [own.identity, orphan.identity]
    try:
        assert report["code"] == 5  # the real status: nothing else reaped the worker
        assert own.sid == own.pid and orphan.ppid == worker.pid
        if mode == "subreaper":
            assert report == {"subreaper": True, "code": 5, "killed": 2}
            assert wait_gone(helpers) == []
        else:
            assert report["killed"] == 0
            assert [process_identity(pid) for pid, _ in helpers] == helpers  # still running
    finally:
        for pid, start in helpers:
            if process_identity(pid) == (pid, start):
                os.kill(pid, signal.SIGKILL)
