"""Worker logic (`services/reward/worker.py`) called in-process: every failure of a
function becomes an ERROR result with its message, never an exception. And the service
with real workers as pid 1 of its own pid namespace, as in a container."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import yaml

from flywheel_proto.v1 import reward_pb2, reward_pb2_grpc
from services.reward.worker import Worker, as_reward

ROOT = Path(__file__).resolve().parents[2]

FAULTY = "tests.reward.faulty"


def item(fn: str, completion: str = "#### 3", answer: str = "3", **kwargs: object) -> dict:
    return {
        "id": 0,
        "fn": fn,
        "prompt": "p",
        "completion": completion,
        "prompt_ids": [1, 2, 3],
        "completion_ids": [4],
        "answer": answer,
        "kwargs": kwargs,
    }


def test_ok_error_and_bad_return_values() -> None:
    w = Worker(cpu_seconds=0, memory_bytes=0)
    ok = w.score(item("services.reward.builtins:arithmetic_reward"))
    assert (ok["status"], ok["reward"], ok["message"]) == ("OK", 1.0, "")
    assert ok["t1"] >= ok["t0"]
    raised = w.score(item(f"{FAULTY}:raises"))
    assert raised["status"] == "ERROR" and raised["message"] == "ValueError: bad answer field '3'"
    assert w.score(item(f"{FAULTY}:returns_nan"))["message"].startswith(
        "ValueError: reward function returned nan"
    )
    assert "returned str" in w.score(item(f"{FAULTY}:returns_text"))["message"]
    missing = w.score(item("no_such_pkg_xyz:fn"))
    assert missing["status"] == "ERROR" and "ModuleNotFoundError" in missing["message"]
    assert not any(r["restart"] for r in (ok, raised, missing))


def test_kwargs_and_ids_reach_the_function() -> None:
    w = Worker(cpu_seconds=0, memory_bytes=0)
    # echo_kwargs: weight * len(prompt_ids) + (prompt == "p") = 2.5 * 3 + 1 = 8.5
    assert w.score(item(f"{FAULTY}:echo_kwargs", weight=2.5))["reward"] == 8.5


@pytest.mark.parametrize(("value", "expected"), [(True, 1.0), (0, 0.0), (0.25, 0.25)])
def test_as_reward_accepts_real_numbers(value: object, expected: float) -> None:
    assert as_reward(value) == expected


@pytest.mark.parametrize("value", [None, "1", [1.0], float("inf")])
def test_as_reward_refuses_the_rest(value: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        as_reward(value)


# --- the service as pid 1 (a container's or a pod's layout) ---------------------------------


def _pid_namespace_prefix() -> list[str]:
    """`unshare` arguments that run a command as pid 1 of a new pid namespace (as root, or
    in a user namespace where those are allowed), or skip the test where neither works."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    base = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    for prefix in (base, [*base[:1], "--user", "--map-root-user", *base[1:]]):
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return prefix
    pytest.skip("no new pid namespace here (needs root or unprivileged user namespaces)")


def _only_child(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _pid_in_its_namespace(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError(f"no NSpid line for {pid}")


@pytest.mark.integration
def test_service_as_pid_1_starts_workers_scores_and_stops(tmp_path: Path) -> None:
    """In a container the reward service is pid 1, so its workers' parent pid is 1 while the
    service lives: the worker must not read that as "the service died" (it did: every worker
    exited at start, WorkerGone, and the service never became healthy)."""
    cfg = {
        "experiment_name": "reward-pid1",
        "trial_name": "t",
        "cluster": {"fileroot": str(tmp_path)},
        "actor": {"kl_ctl": 0.0},
        "services": {"reward": {"port": 0, "metrics_port": 0}},
        "reward": {"fn": "gsm8k", "num_workers": 1},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [*_pid_namespace_prefix(), sys.executable, "-m", "services.reward", "--config", str(path)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        address = None
        for line in proc.stderr:  # JSON log lines; the serving one carries the address
            lines.append(line)
            if '"reward service serving"' in line:
                address = json.loads(line)["address"]
                break
        assert address is not None, "".join(lines)
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        service_pid = _only_child(proc.pid)
        assert _pid_in_its_namespace(service_pid) == 1
        with grpc.insecure_channel(address) as channel:
            res = reward_pb2_grpc.RewardServiceStub(channel).Score(
                reward_pb2.ScoreRequest(completion=b"#### 7", answer="#### 7"), timeout=60
            )
        assert (res.status, res.reward) == (reward_pb2.REWARD_STATUS_OK, 1.0), res.message
        # pid 1 gets only the signals it handles: SIGTERM must still stop it cleanly.
        os.kill(service_pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
