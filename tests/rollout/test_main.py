"""`python -m services.rollout --config FILE --eval-only` as a user (or the launcher) runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.core.types import SamplingParams
from services.rollout.client import RolloutClient

pytestmark = pytest.mark.integration


def wait_for_log(proc: subprocess.Popen[str], msg: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                raise AssertionError(f"rollout exited with {proc.returncode}")
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("msg") == msg:
            return rec
    raise AssertionError(f"no {msg!r} log line within {timeout}s")


async def test_entry_serves_generate_metrics_and_stops_on_sigterm(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = tmp_path / "rollout.yaml"
    cfg.write_text(
        f"actor: {{path: {tiny_model_dir}, kl_ctl: 0.0}}\n"
        "rollout: {engine: torch, torch_max_batch_size: 4}\n"
        "services: {rollout: {port: 0, metrics_port: 0}}\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.rollout",
            "--config",
            str(cfg),
            "--eval-only",
            "--replica-index",
            "2",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    try:
        rec = wait_for_log(proc, "rollout serving")
        assert rec["rollout_id"] == "rollout-2" and rec["service"] == "rollout"
        async with RolloutClient(f"127.0.0.1:{rec['port']}") as client:
            res = await client.generate(
                prompts=["12+3="], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True)
            )
            assert len(res.completions[0].output_ids) == 4
            stats = await client.stats()
            assert stats.rollout_id == "rollout-2" and stats.engine == "torch"
        deadline = time.monotonic() + 120  # a guard: a loaded machine may run it late
        while True:  # the metrics sync runs every second
            body = (
                urllib.request.urlopen(f"http://127.0.0.1:{rec['metrics_port']}/metrics")
                .read()
                .decode()
            )
            if "flywheel_rollout_generated_tokens_total 4.0" in body or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "flywheel_rollout_generated_tokens_total 4.0" in body
        assert "flywheel_rollout_weight_version 0.0" in body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_config_exits_2_naming_the_problem(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("actor: {kl_ctl: 0.0}\nrollout: {engine: torch}\n")
    out = subprocess.run(
        [sys.executable, "-m", "services.rollout", "--config", str(cfg), "--eval-only"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "actor.path" in out.stderr
