"""`python -m services.reward --config FILE` as the launcher runs it: serves, answers,
stops cleanly on SIGTERM; a bad function name exits 2 naming it; it starts from a file with
only its own blocks, and from one whose trainer part is wrong (it checks only what it reads)."""

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


# A trainer-only mistake: a KL penalty without a reference model (`flywheel run` refuses it).
TRAINER_ERROR = {"actor": {"kl_ctl": 0.1}}


def write_config(tmp_path: Path, reward: dict, **blocks: dict) -> Path:
    cfg = {
        "services": {"reward": {"port": 0, "metrics_port": 0}},
        "reward": reward,
        **blocks,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("blocks", [{}, TRAINER_ERROR], ids=["reward-only", "trainer-error"])
def test_check_passes_on_what_the_reward_service_reads(tmp_path: Path, blocks: dict) -> None:
    path = write_config(tmp_path, {"fn": "gsm8k"}, **blocks)
    done = subprocess.run(
        [sys.executable, "-m", "services.reward", "--check", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "reward: check passed (fn=gsm8k)" in done.stdout
    # The trainer's problem is named in the log, not fatal here.
    assert ("actor.kl_ctl: not checked for the reward service" in done.stderr) == bool(blocks)
    trainer_view = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", "--config", str(path), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert trainer_view.returncode == (2 if blocks else 0), trainer_view.stderr


def test_entry_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    # Started from a file whose trainer part is wrong: the reward service does not read it.
    path = write_config(tmp_path, {"fn": "gsm8k", "num_workers": 1}, **TRAINER_ERROR)
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
