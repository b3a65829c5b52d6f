"""`flywheel run` as a user runs it: four services, real Redis, real gRPC, a few steps.

A very small model and batch keep this under a few minutes on two cores; what is checked is
the machinery (invariants, metrics over HTTP, checkpoints, recovery), not learning, which the
demo (`make run`) shows.
"""

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

from tests.run_configs import tiny_run_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FLYWHEEL = [sys.executable, "-m", "services.cli"]


def small_config(tmp_path: Path, **extra) -> Path:
    steps = extra.pop("steps", 4)
    cfg = tiny_run_config(tmp_path / "runs", experiment="e2e", steps=steps)
    cfg["launcher"]["warm_start"] = {
        "enabled": True,
        "steps": 20,
        "batch_size": 32,
        "warmup_steps": 5,
    }
    cfg["launcher"]["eval"] = {"freq_steps": 0, "n_prompts": 16}
    cfg["valid_dataset"] = {"builtin": "arithmetic", "builtin_size": 32, "shuffle": False}
    cfg["trainer"]["save_freq_steps"] = 2
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = tmp_path / "e2e.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


OPERATOR_TOKEN = "operator-tok-e2e-5ecret"


def test_run_end_to_end_checks_invariants_metrics_and_checkpoint(tmp_path: Path):
    """With auth on, as a user starts it with `FLYWHEEL_TOKEN` set: every call a
    service or the launcher makes is within its role (a missing permission would fail the
    run), the held-out evaluation (Generate, Score) works with the launcher's token, and the
    operator's token is in no file of the run."""
    config = small_config(tmp_path)
    proc = subprocess.run(
        [*FLYWHEEL, "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**_env(), "FLYWHEEL_TOKEN": OPERATOR_TOKEN},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "runs" / "e2e" / "t"
    logs = proc.stderr + "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "PERMISSION_DENIED" not in logs and "UNAUTHENTICATED" not in logs
    for path in run_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert OPERATOR_TOKEN.encode() not in path.read_bytes(), path
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    assert summary["invariants_ok"], summary["invariants"]
    assert summary["max_staleness_seen"] <= 1
    for name in (
        "staleness_within_eta",
        "versions_increase",
        "buffer_accounting",
        "metrics_exported",
    ):
        assert summary["invariants"][name]["ok"], (name, summary["invariants"][name])
    assert (
        summary["initial_eval_accuracy"] is not None and summary["final_eval_accuracy"] is not None
    )
    assert [e["n"] for e in summary["evals"]] == [16, 16]  # before and after training
    # Neither evaluation overlaps training: each saw one version, the first the initial
    # weights, the last the final step's (versions 1..4 are the steps).
    assert [(e["version_min"], e["version"]) for e in summary["evals"]] == [(0, 0), (4, 4)]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    consumed = [g for r in records for g in r["group_ids"]]
    assert len(consumed) == len(set(consumed)) == 4 * 4  # no group trained twice
    assert any((run_dir / "checkpoints").iterdir()), "no checkpoint written"
    assert (run_dir / "learning_curve.png").stat().st_size > 0
    for svc in ("buffer", "reward", "rollout-0", "trainer"):
        assert (run_dir / "logs" / f"{svc}.log").exists()


# A kill -9 of a rollout replica (its restart, the run finishing its steps, the ledger, no
# group trained twice, every trained group acked once) is tested with each other fault, one
# short run each, in tests/chaos/test_faults.py.


def test_a_starved_trainer_is_diagnosed_and_a_service_dying_too_often_ends_the_run(
    tmp_path: Path,
):
    # One run, two supervision checks (a run costs a minute on two cores):
    # 1. the reward service is SIGSTOPped: the rollout cannot finish groups, the trainer
    #    waits for data, and after launcher.starvation_timeout_seconds the watchdog names
    #    the stage that holds the run (reward) in the output and in starvation.json; after
    #    SIGCONT the steps resume and starvation.json is gone. (A stopped rollout replica
    #    would hold the trainer in its weight push instead: not starvation.)
    # 2. launcher.max_restarts=1: the first kill -9 of the buffer is ridden through, the
    #    second within the window ends the run (exit 1) naming the budget, and the
    #    launcher still stops every other service.
    config = small_config(
        tmp_path,
        steps=200,
        launcher={
            "warm_start": {"enabled": False},
            "max_restarts": 1,
            "restart_backoff_seconds": 0.2,
            "starvation_timeout_seconds": 6.0,
            "liveness_timeout_seconds": 600.0,  # the stopped reward is not killed
        },
    )
    run_dir = tmp_path / "runs" / "e2e" / "t"
    log = tmp_path / "launcher.log"
    proc = subprocess.Popen(
        [*FLYWHEEL, "run", "--config", str(config)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=_env(),
    )

    def wait_for(what: str, cond) -> None:
        deadline = time.monotonic() + 400
        while not cond():
            assert proc.poll() is None, f"run ended waiting for {what}: {log.read_text()[-4000:]}"
            if time.monotonic() > deadline:
                pytest.fail(f"no {what}: {log.read_text()[-4000:]}")
            time.sleep(0.2)

    def pids() -> dict[str, int]:
        while True:  # the launcher rewrites the file in place on a restart: read it whole
            try:
                return json.loads((run_dir / "pids.json").read_text())
            except json.JSONDecodeError:
                time.sleep(0.05)

    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for("a step", lambda: metrics.exists() and metrics.read_text().count("\n") >= 1)
        starvation = run_dir / "starvation.json"
        reward = pids()["reward"]
        os.kill(reward, signal.SIGSTOP)
        try:
            read: list[dict] = []

            def verdict_written() -> bool:  # written in place: it may be seen half-written
                try:
                    read.append(json.loads(starvation.read_text()))
                except (FileNotFoundError, json.JSONDecodeError):
                    return False
                return True

            wait_for("the starvation verdict", verdict_written)
            verdict = read[-1]
        finally:
            os.kill(reward, signal.SIGCONT)
        steps = metrics.read_text().count("\n")
        wait_for("steps again", lambda: metrics.read_text().count("\n") > steps)
        wait_for("the verdict withdrawn", lambda: not starvation.exists())
        first = pids()["buffer"]
        os.kill(first, signal.SIGKILL)
        restarts = run_dir / "restarts.jsonl"
        wait_for("the buffer's restart", lambda: restarts.exists() and pids()["buffer"] != first)
        others = [pid for name, pid in pids().items() if name != "buffer"]
        os.kill(pids()["buffer"], signal.SIGKILL)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    out = log.read_text()
    assert verdict["stage"] == "reward holds", verdict
    assert verdict["numbers"]["reward_up"] is False
    assert verdict["numbers"]["pending"] < 4  # less than a batch (consumer_batch_size 4)
    assert "starving: no training step for" in out
    assert "s: reward holds (the reward service does not answer)" in out
    assert proc.returncode == 1, out[-4000:]
    assert (
        "FAILED: buffer died (signal SIGKILL) after 1 restarts within 600s "
        "(launcher.max_restarts=1)" in out
    ), out[-4000:]
    assert [json.loads(x)["service"] for x in restarts.read_text().splitlines()] == ["buffer"]
    for pid in others:  # stopped by the launcher on its way out
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
