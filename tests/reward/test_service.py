"""The assembled reward service (`services/reward/service.py`) over real gRPC and HTTP:
its gRPC health follows the workers as `/readyz` does, failed worker starts are counted,
and `python -m services.reward` (`serve_forever`, a subreaper) leaves nothing running
that a worker which died on its own had started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from flywheel_proto.v1 import reward_pb2, reward_pb2_grpc
from tests.reward.conftest import (
    FAULTY,
    RunningReward,
    process_identity,
    read_started,
    service_config,
    wait_gone,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def wait_for(what: str, condition: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {timeout:g}s"
        time.sleep(0.05)


def test_health_is_not_serving_while_no_worker_can_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A regression: /readyz said 503 while no worker could start, gRPC health said SERVING,
    # and the failed starts were only logged.
    gate = tmp_path / "gate"
    monkeypatch.setenv("FLYWHEEL_REWARD_TEST_GATE", str(gate))
    svc = RunningReward(
        service_config(num_workers=1, functions={"gate": "tests.reward.start_gate:score"}),
        metrics=True,
    )
    try:
        health = health_pb2_grpc.HealthStub(svc.channel)
        metrics_url = f"http://127.0.0.1:{svc.service.metrics_port}"

        def status(service: str = "flywheel.v1.RewardService") -> int:
            req = health_pb2.HealthCheckRequest(service=service)
            return int(health.Check(req, timeout=10).status)

        def start_failures() -> float:
            text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
            for family in text_string_to_metric_families(text):
                if family.name == "flywheel_reward_worker_start_failures":
                    return float(family.samples[0].value)
            raise AssertionError("flywheel_reward_worker_start_failures_total not exported")

        def readyz() -> int:
            return httpx.get(f"{metrics_url}/readyz", timeout=10).status_code

        assert (status(), status(""), readyz(), start_failures()) == (SERVING, SERVING, 200, 0.0)

        gate.touch()  # from now on a worker exits while importing the registered functions
        [pid] = svc.worker_pids()
        os.kill(pid, signal.SIGKILL)
        # Two failed starts in a row (the second after a back-off) and none ready between:
        # the service is down for scoring, and every probe says so.
        wait_for("two failed worker starts", lambda: start_failures() >= 2)
        assert svc.service.pool.ready_workers == 0
        assert (status(), status(""), readyz()) == (NOT_SERVING, NOT_SERVING, 503)

        gate.unlink()
        wait_for("health SERVING again", lambda: status() == SERVING)
        assert (status(""), readyz()) == (SERVING, 200)
        res = svc.stub.Score(
            reward_pb2.ScoreRequest(completion=b"#### 10", answer="10"), timeout=60
        )
        assert (res.status, res.reward) == (reward_pb2.REWARD_STATUS_OK, 1.0)
    finally:
        svc.stop()


def test_a_worker_that_dies_on_its_own_takes_its_helpers_along(tmp_path: Path) -> None:
    # A regression: a worker that exits by itself (os._exit here; a segfault or the OOM killer
    # alike) left its helpers in other sessions running. Now the tree kill catches them
    # while the dying worker still holds them, or the service, their subreaper once the
    # worker is gone, kills and reaps them (test_process.py checks that path alone).
    config = tmp_path / "reward.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "services": {"reward": {"port": 0, "metrics_port": 0}},
                "reward": {
                    "fn": "gsm8k",
                    "num_workers": 1,
                    "functions": {"helpers": f"{FAULTY}:starts_helpers"},
                },
            }
        )
    )
    service = subprocess.Popen(
        [sys.executable, "-m", "services.reward", "--config", str(config)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    helpers: list[tuple[int, int]] = []
    try:
        assert service.stderr is not None
        log: list[str] = []
        for line in service.stderr:  # JSON log lines; the serving one names the address
            log.append(line)
            if '"reward service serving"' in line:
                address = json.loads(line)["address"]
                break
        else:
            raise AssertionError("".join(log))
        threading.Thread(target=service.stderr.read, daemon=True).start()
        pid_file = tmp_path / "pids"
        with grpc.insecure_channel(address) as channel:
            res = reward_pb2_grpc.RewardServiceStub(channel).Score(
                reward_pb2.ScoreRequest(
                    fn="helpers",
                    completion=b"x",
                    kwargs_json=json.dumps({"pid_file": str(pid_file), "then": "exit"}),
                ),
                timeout=60,
            )
        assert res.status == reward_pb2.REWARD_STATUS_ERROR
        assert "died while scoring (exit code 5)" in res.message
        own, orphan, worker = read_started(pid_file)
        helpers = [own.identity, orphan.identity]
        assert worker.ppid == service.pid
        assert own.sid == own.pid and orphan.ppid == worker.pid  # out of the group kill's reach
        assert wait_gone(helpers) == []
        service.send_signal(signal.SIGTERM)
        assert service.wait(timeout=60) == 0
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()
        for pid, start in helpers:  # cleanup after a failed assertion
            if process_identity(pid) == (pid, start):
                os.kill(pid, signal.SIGKILL)
