"""`flywheel status` shows what the launcher's supervision did: restarts per service and the
last ones, read from the run's `restarts.jsonl`, and the starvation watchdog's verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from services.launcher.main import status_main


def test_status_lists_the_restarts_of_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = {"grpc": "127.0.0.1:1", "metrics": "http://127.0.0.1:1/metrics"}
    info = {"buffer": dead, "reward": dead, "trainer": dead, "rollout": [dead]}
    (run_dir / "services.json").write_text(json.dumps(info))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"total_train_steps": 6}))
    records = [
        {"service": "buffer", "exit": "signal SIGKILL", "downtime_seconds": 7.9},
        {"service": "reward", "exit": "exit code 1", "downtime_seconds": 12.5},
        {"service": "buffer", "exit": "signal SIGKILL", "downtime_seconds": 8.1},
    ]
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "restarts.jsonl").write_text(lines + '{"service": "rew')  # one being written
    verdict = {"stage": "no capacity", "detail": "capacity 0 at version 5", "numbers": {}}
    (run_dir / "starvation.json").write_text(json.dumps({**verdict, "before": {}, "now": {}}))
    assert status_main([str(run_dir)]) == 1  # nothing answers on port 1
    out = json.loads(capsys.readouterr().out)
    assert out["restarts"]["total"] == 3
    assert out["restarts"]["per_service"] == {"buffer": 2, "reward": 1}
    assert out["restarts"]["last"][-1] == records[-1]
    assert out["buffer"]["health"] == "UNREACHABLE"
    assert out["starvation"] == verdict
