"""`python -m services.reward --config FILE` as the launcher runs it: serves, answers,
stops cleanly on SIGTERM; a bad function name exits 2 naming it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flywheel_proto.v1 import reward_pb2, reward_pb2_grpc

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, reward: dict) -> Path:
    cfg = {
        "experiment_name": "reward-main",
        "trial_name": "t",
        "cluster": {"fileroot": str(tmp_path)},
        "actor": {"kl_ctl": 0.0},
        "services": {"reward": {"port": 0, "metrics_port": 0}},
        "reward": reward,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_entry_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"fn": "gsm8k", "num_workers": 1})
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.reward", "--config", str(path)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = None
        lines: list[str] = []
        assert proc.stderr is not None
        for line in proc.stderr:  # JSON log lines; the serving one carries the address
            lines.append(line)
            if '"reward service serving"' in line:
                address = json.loads(line)["address"]
                break
        assert address is not None, "".join(lines)
        drain = threading.Thread(target=proc.stderr.read, daemon=True)
        drain.start()
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="flywheel.v1.RewardService"), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            res = reward_pb2_grpc.RewardServiceStub(channel).Score(
                reward_pb2.ScoreRequest(completion=b"#### 7", answer="#### 7"), timeout=60
            )
            assert (res.status, res.reward) == (reward_pb2.REWARD_STATUS_OK, 1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unknown_function_exits_2_naming_it(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"fn": "gsm9k"})
    done = subprocess.run(
        [sys.executable, "-m", "services.reward", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "fn 'gsm9k' is not a registered reward function" in done.stderr
