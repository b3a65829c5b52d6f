"""Chaos: a real `flywheel run` (tiny model, real redis-server, all four services) survives a
kill -9 of each of its processes in turn, and keeps the promises of the design.

One run, six faults: SIGKILL of the buffer, of the reward service, of a rollout replica, of
the trainer (after a checkpoint) and of the local redis-server, then a SIGSTOP of the reward
service for longer than its deadline (the launcher's liveness probe finds it silent, kills
and restarts it). Each comes at a random moment after the trainer made progress since the
last fault (the seed is printed). One run instead of six keeps the suite to a few minutes
on two cores; each fault is still checked on its own (its restart is listed with how the
process ended; the run made progress after it). At the end:

- the run finishes its steps and exits 0; `summary.json` lists every restart with how the
  process ended and how long the service was down;
- the buffer's ledger holds: put = acked + dropped + pending + in flight;
- no group id is trained twice (across the trainer's lives: the steps a dead trainer made
  after its last checkpoint are in `metrics.lost.jsonl`, at most `save_freq_steps` of them)
  and no step record is written twice; the staleness bound eta is never exceeded;
- no process of the run is left behind (every pid the launcher listed, and every process
  that carries the run directory in its environment, reward workers included).

Time limits below are bounds on a hung run, not assertions about speed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.run_configs import tiny_run_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FLYWHEEL = [sys.executable, "-m", "services.cli"]
FAULTS = (
    ("buffer", signal.SIGKILL),
    ("reward", signal.SIGKILL),
    ("rollout-0", signal.SIGKILL),
    ("trainer", signal.SIGKILL),
    ("redis-server", signal.SIGKILL),
    ("reward", signal.SIGSTOP),
)
VICTIMS = ("buffer", "reward", "rollout-0", "trainer", "redis-server")
STEPS = 30
ETA = 1
SAVE_FREQ = 2
LIVENESS_S = 6.0


def _config(tmp_path: Path) -> Path:
    cfg = tiny_run_config(tmp_path / "runs", experiment="chaos", steps=STEPS)
    cfg["launcher"].update(
        {
            "max_restarts": 3,
            "restart_backoff_seconds": 0.2,
            "restart_backoff_max_seconds": 2.0,
            "liveness_timeout_seconds": LIVENESS_S,
        }
    )
    cfg["rollout"]["max_head_offpolicyness"] = ETA
    cfg["reward"]["deadline_ms"] = 3000  # the SIGSTOP outlasts it
    cfg["trainer"]["save_freq_steps"] = SAVE_FREQ
    path = tmp_path / "chaos.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _of_run(run_dir: Path) -> list[int]:
    """Pids of live processes that carry this run's directory in their environment."""
    marker = f"FLYWHEEL_RUN_DIR={run_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return [pid for pid in found if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead, only not yet reaped
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class _Run:
    def __init__(self, tmp_path: Path) -> None:
        self.run_dir = tmp_path / "runs" / "chaos" / "t"
        self.log = tmp_path / "launcher.log"
        self.proc = subprocess.Popen(
            [*FLYWHEEL, "run", "--config", str(_config(tmp_path))],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.pids_seen: set[int] = set()

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def wait_for(self, what: str, cond: Callable[[], bool], bound: float = 300.0) -> None:
        deadline = time.monotonic() + bound
        while not cond():
            if self.proc.poll() is not None:
                pytest.fail(
                    f"run ended ({self.proc.returncode}) waiting for {what}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {bound:.0f}s:\n{self.output()}")
            time.sleep(0.2)

    def steps(self) -> int:
        return len(_jsonl(self.run_dir / "metrics.jsonl"))

    def stepped_since(self, steps: int) -> Callable[[], bool]:
        return lambda: self.steps() > steps

    def has_checkpoint(self) -> bool:
        ckpts = self.run_dir / "checkpoints"
        return ckpts.is_dir() and any(ckpts.iterdir())

    def pids(self) -> dict[str, int]:
        path = self.run_dir / "pids.json"
        try:
            pids = {k: int(v) for k, v in json.loads(path.read_text()).items() if v}
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        self.pids_seen.update(pids.values())
        return pids

    def restarts_of(self, name: str) -> list[dict[str, Any]]:
        return [r for r in _jsonl(self.run_dir / "restarts.jsonl") if r["service"] == name]

    def stop(self) -> None:
        if self.proc.poll() is None:  # let the launcher stop its services before giving up
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_run_survives_kill_9_of_each_service_in_turn(tmp_path: Path):
    seed = int(os.environ.get("FLYWHEEL_CHAOS_SEED", random.randrange(1 << 30)))
    print(f"chaos seed {seed} (FLYWHEEL_CHAOS_SEED={seed} repeats these moments)")
    rng = random.Random(seed)
    run = _Run(tmp_path)
    try:
        run.wait_for("first step", lambda: run.steps() >= 1)
        for victim, sig in FAULTS:
            before = run.steps()
            if victim == "trainer":  # a checkpoint to resume from
                run.wait_for("checkpoint", run.has_checkpoint)
            # Groups are in flight: the trainer made a step since the last fault.
            run.wait_for(f"a step before {sig.name} of {victim}", run.stepped_since(before))
            time.sleep(rng.uniform(0.0, 1.0))
            restarts_before = len(run.restarts_of(victim))
            pid = run.pids()[victim]
            os.kill(pid, sig)
            run.wait_for(
                f"{victim} restarted after {sig.name}",
                lambda: any(
                    r["restarted_at"]
                    for r in run.restarts_of(victim)[restarts_before:]  # noqa: B023
                ),
            )
            assert run.pids()[victim] != pid
        run.proc.wait(timeout=600)
    finally:
        run.pids()
        run.stop()
    out = run.output()
    assert run.proc.returncode == 0, out

    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    restarted = {r["service"]: r for r in summary["restarts"]}
    assert set(VICTIMS) <= set(restarted), summary["restarts"]
    for victim in VICTIMS:
        first = next(r for r in summary["restarts"] if r["service"] == victim)
        assert first["exit"] == "signal SIGKILL" and first["exit_code"] == -9, first
        assert first["downtime_seconds"] is not None and first["downtime_seconds"] > 0, first
        assert first["reason"] is None  # it died; the launcher did not kill it
    # The stopped reward service: killed by the launcher once silent for the liveness time.
    hung = [r for r in summary["restarts"] if r["service"] == "reward"][1]
    assert hung["exit"] == "signal SIGKILL" and "no answer to its health check" in hung["reason"]
    assert hung["downtime_seconds"] > 0
    assert summary["restarts_total"] == len(summary["restarts"])
    for victim in VICTIMS:  # announced when it happens and in the closing lines
        assert f"{victim} died (signal SIGKILL): restarting" in out
        assert f"restart: {victim} (signal SIGKILL), down" in out

    assert summary["invariants"]["buffer_accounting"]["ok"], summary["invariants"]
    buffer = summary["buffer"]
    dropped = sum(int(v) for v in (buffer.get("dropped_total") or {}).values())
    assert int(buffer["put_total"]) == (
        int(buffer["acked_total"]) + dropped + int(buffer["pending"]) + int(buffer["in_flight"])
    )
    assert summary["invariants"]["staleness_within_eta"]["ok"], summary["invariants"]

    records = _jsonl(run.run_dir / "metrics.jsonl")
    steps = [r["step"] for r in records if "step" in r]
    assert len(steps) == len(set(steps)), f"step records written twice: {steps}"
    assert sorted(steps) == list(range(1, STEPS + 1))
    lost = _jsonl(run.run_dir / "metrics.lost.jsonl")
    assert len(lost) <= SAVE_FREQ, lost
    trained = [g for r in records + lost for g in r.get("group_ids", [])]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert max(r["staleness_max"] for r in records + lost) <= ETA

    left = sorted({pid for pid in run.pids_seen if _alive(pid)} | set(_of_run(run.run_dir)))
    assert not left, f"processes of the run left behind: {left}"
