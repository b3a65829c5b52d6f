"""`flywheel doctor` on a real `flywheel run` (four services, real Redis, real gRPC), once
while it trains and its services are scraped, once after it stopped.

The run is the smallest one (tests/run_configs.py) without a warm start: an untrained model
rarely says EOS within `max_new_tokens` 8, so the run truncates for real and doctor must
say so, while the mechanics it checks (importance weight exactly 1 with one minibatch,
staleness within eta, every weight push applied, rewards computed) hold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from services.cli import main
from tests.run_configs import tiny_run_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_doctor_on_a_real_run_live_and_stopped(tmp_path: Path, capsys):
    cfg = tiny_run_config(tmp_path / "runs", experiment="doctor", steps=500)
    config = tmp_path / "doctor.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "runs" / "doctor" / "t"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "run", "--config", str(config)],
        stdout=(tmp_path / "run.log").open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
            if time.monotonic() > deadline:
                pytest.fail("no training steps: " + (tmp_path / "run.log").read_text()[-4000:])
            time.sleep(0.5)
        capsys.readouterr()
        # A generous scrape: four busy services on two cores may take more than the
        # default 3 s to answer, and a late /metrics would read as unreachable.
        live_rc = main(["doctor", str(run_dir), "--json", "--scrape-timeout", "60"])
        live = json.loads(capsys.readouterr().out)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    checks = {c["name"]: c for c in live["checks"]}
    assert live["live"] and live["unreachable"] == [], live
    # scraped from the running rollout and reward services
    rf = checks["reward_failures"]
    assert rf["status"] == "pass" and rf["numbers"]["completions"] > 0, rf
    assert rf["numbers"]["reward_results_by_status"].get("OK", 0) > 0, rf
    assert checks["dropped_groups"]["numbers"]["put"] > 0
    # one minibatch, pi_prox recomputed, float32
    iw = checks["importance_weight"]
    assert iw["status"] == "pass" and iw["numbers"]["max_abs_dev"] <= 1e-4, iw
    assert checks["staleness"]["status"] == "pass"
    assert checks["weight_sync"]["status"] == "pass"
    # the untrained model runs into max_new_tokens: real truncation, a failed run
    ne = checks["no_eos_ratio"]
    assert ne["status"] == "fail" and ne["numbers"]["recent_mean"] > 0.25, ne
    assert live["verdict"] == "fail" and live_rc == 2

    assert main(["doctor", str(run_dir)]) == 2
    out = capsys.readouterr().out
    assert "FAIL  no_eos_ratio" in out and "raise gconfig.max_new_tokens" in out
    assert out.splitlines()[-1].startswith("verdict: fail")


def test_experiments_run_the_three_runs_and_name_a_branch(tmp_path: Path, capsys):
    # An untrained tiny model: held-out accuracy 0 before and after each short run, nothing
    # rises, so the tree ends at "model" (the starting model cannot score).
    cfg = tiny_run_config(tmp_path / "runs", experiment="dx", steps=3)
    cfg["launcher"]["eval"] = {"freq_steps": 0, "n_prompts": 16}
    cfg["valid_dataset"] = {"builtin": "arithmetic", "builtin_size": 32, "shuffle": False}
    config = tmp_path / "dx.yaml"
    config.write_text(yaml.safe_dump(cfg))
    rc = main(["doctor", "--config", str(config), "--experiments", "--json"])
    report = json.loads(capsys.readouterr().out)
    root = tmp_path / "runs" / "dx-doctor"
    assert [r["name"] for r in report["runs"]] == ["async", "sync", "test_set"]
    for r in report["runs"]:
        assert r["exit_code"] == 0 and r["run_dir"] == str(root / r["name"]), r
        assert r["samples"] == 3 * 16 and r["baseline_accuracy"] is not None, r
    sync = yaml.safe_load((root / "sync" / "config.yaml").read_text())
    assert sync["rollout"]["max_head_offpolicyness"] == 0
    test_set = yaml.safe_load((root / "test_set" / "config.yaml").read_text())
    assert test_set["train_dataset"]["path"].endswith("async/data/valid.jsonl")
    assert report["branch"] == "model" and rc == 1, report
