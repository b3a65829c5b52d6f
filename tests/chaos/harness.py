"""What every chaos test shares: a short real `flywheel run` (the tiny model, the local
redis-server with AOF `everysec`, all four services) started as a user starts it, the fault
injected at a random moment while groups are in flight, and the promises checked at the end.

The promises, checked by `check_promises` for every fault:

- the run finishes its steps and exits 0; the fault's restart is in `summary.json` with how
  the process ended and how long the service was down;
- the buffer's ledger holds: put = acked + dropped + pending + in flight;
- no group id is trained twice (across the trainer's lives: the steps a dead trainer made
  after its last checkpoint are in `metrics.lost.jsonl`) and no step record is written twice;
- the staleness bound eta is never exceeded;
- lost work is at most what the fault can lose: Redis's lost puts (`summary.json`
  `buffer.lost_puts_detected`) are zero unless Redis itself was killed, steps lost with a
  trainer at most its checkpoint interval, and groups acknowledged by a dead trainer after
  its checkpoint are named in `summary.json` `ledger` (they match `metrics.lost.jsonl`);
- no process of the run is left behind (every pid the launcher listed, and every process
  that carries the run directory in its environment, reward workers included).

The moments are random (the seed is printed; `FLYWHEEL_CHAOS_SEED` repeats them). Time
limits below bound a hung run; nothing asserts how fast anything was.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.run_configs import tiny_run_config

FLYWHEEL = [sys.executable, "-m", "services.cli"]
STEPS = 40  # long enough that a fault in its first half finds work in flight
BATCH = 4  # groups per step (tiny_run_config's rollout.consumer_batch_size)
ETA = 1
SAVE_FREQ = 2
LIVENESS_S = 6.0  # the SIGSTOP test's; the other faults keep the default (below)
GENEROUS_LIVENESS_S = 120.0  # launcher's default: a loaded machine's slow answer is no hang
REWARD_DEADLINE_MS = 3000


def chaos_config(tmp_path: Path, liveness_s: float) -> Path:
    cfg = tiny_run_config(tmp_path / "runs", experiment="chaos", steps=STEPS)
    cfg["launcher"].update(
        {
            "max_restarts": 3,
            "restart_backoff_seconds": 0.2,
            "restart_backoff_max_seconds": 2.0,
            "liveness_timeout_seconds": liveness_s,
        }
    )
    cfg["rollout"]["max_head_offpolicyness"] = ETA
    cfg["reward"]["deadline_ms"] = REWARD_DEADLINE_MS  # the SIGSTOP test outlasts it
    cfg["trainer"]["save_freq_steps"] = SAVE_FREQ
    path = tmp_path / "chaos.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead, only not yet reaped
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time since boot) of a live process, None when none (or a zombie) runs."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return None if fields[0] == "Z" else (pid, int(fields[19]))  # proc(5) field 22


def of_run(run_dir: Path) -> list[int]:
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
    return [pid for pid in found if alive(pid)]


@dataclass
class Fault:
    """What was done, when, and the buffer's put counter over the seconds before it."""

    victim: str
    sig: signal.Signals
    pid: int
    at: float
    puts_before: list[tuple[float, int]] = field(default_factory=list)

    def puts_within(self, seconds: float) -> int:
        """Puts the buffer acknowledged in the last `seconds` before the fault (from the
        samples taken while waiting for its moment)."""
        if not self.puts_before:
            return 0
        last = self.puts_before[-1][1]
        older = [n for t, n in self.puts_before if t <= self.at - seconds]
        return last - (older[-1] if older else self.puts_before[0][1])


class ChaosRun:
    """One `flywheel run` of `chaos_config`, its output in `launcher.log`."""

    def __init__(self, tmp_path: Path, liveness_s: float = GENEROUS_LIVENESS_S) -> None:
        self.run_dir = tmp_path / "runs" / "chaos" / "t"
        self.log = tmp_path / "launcher.log"
        self.seed = int(os.environ.get("FLYWHEEL_CHAOS_SEED", random.randrange(1 << 30)))
        print(f"chaos seed {self.seed} (FLYWHEEL_CHAOS_SEED={self.seed} repeats these moments)")
        self.rng = random.Random(self.seed)
        self.proc = subprocess.Popen(
            [*FLYWHEEL, "run", "--config", str(chaos_config(tmp_path, liveness_s))],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            # Auth off (no operator token), so the test reads the buffer's counters as is.
            env={
                **{k: v for k, v in os.environ.items() if k != "FLYWHEEL_TOKEN"},
                "PYTHONUNBUFFERED": "1",
            },
        )
        # (pid, start time): a pid of a service that died may name another process later
        # (pids wrap; the other test worker starts processes all the time).
        self.pids_seen: set[tuple[int, int]] = set()
        self._buffer_stub: Any = None

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
        return len(jsonl(self.run_dir / "metrics.jsonl"))

    def has_checkpoint(self) -> bool:
        # Complete ones: the directory appears first, trainer_state.json last (a kill before
        # it would resume from an older checkpoint and lose more than save_freq_steps).
        ckpts = self.run_dir / "checkpoints"
        return ckpts.is_dir() and any(
            p.name.startswith("step") and (p / "trainer_state.json").is_file()
            for p in ckpts.iterdir()
        )

    def pids(self) -> dict[str, int]:
        path = self.run_dir / "pids.json"
        try:
            pids = {k: int(v) for k, v in json.loads(path.read_text()).items() if v}
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        self.pids_seen.update(i for i in map(identity, pids.values()) if i is not None)
        return pids

    def restarts_of(self, name: str) -> list[dict[str, Any]]:
        return [r for r in jsonl(self.run_dir / "restarts.jsonl") if r["service"] == name]

    def buffer_puts(self) -> int | None:
        """The buffer's put counter now (None while it does not answer)."""
        import grpc

        from flywheel_proto.v1 import buffer_pb2_grpc, common_pb2
        from services.common.grpc_client import make_sync_channel

        if self._buffer_stub is None:
            try:
                services = json.loads((self.run_dir / "services.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or half
                return None
            channel = make_sync_channel(services["buffer"]["grpc"])  # auth off, as configured
            self._buffer_stub = buffer_pb2_grpc.BufferServiceStub(channel)
        try:
            return int(self._buffer_stub.Stats(common_pb2.Empty(), timeout=2).put_total)
        except grpc.RpcError:
            return None

    def inject(self, victim: str, sig: signal.Signals, *, after_checkpoint: bool = False) -> Fault:
        """Send `sig` to `victim` at a random step of the first half of the run (after a
        checkpoint when asked): the trainer has made steps and groups are in flight (the
        rollout works ahead of it by up to eta versions). The moment is a step, not a delay:
        a step of the tiny model takes about 0.1 s on a quiet machine and seconds on a loaded
        one, and the fault must land while the run still needs the victim. The buffer's put
        counter is sampled from its first answer up to the fault."""
        target = self.rng.randint(2, STEPS // 2)
        samples: list[tuple[float, int]] = []
        while True:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"run ended ({self.proc.returncode}) before its fault:\n{self.output()}"
                )
            puts = self.buffer_puts()
            if puts is not None:
                samples.append((time.monotonic(), puts))
            if self.steps() >= target and (not after_checkpoint or self.has_checkpoint()):
                break
            time.sleep(0.02)
        pid = self.pids()[victim]
        os.kill(pid, sig)
        fault = Fault(victim, sig, pid, time.monotonic(), samples)
        at = self.steps()
        print(f"{sig.name} of {victim} (pid {pid}) at step {at} (aimed at {target})")
        assert at < STEPS, f"the run outran its fault: step {at} of {STEPS}"
        return fault

    def wait_restarted(self, victim: str, before: int = 0) -> None:
        self.wait_for(
            f"{victim} restarted",
            lambda: any(r["restarted_at"] for r in self.restarts_of(victim)[before:]),
        )

    def finish(self) -> dict[str, Any]:
        """Wait for the run to end; returns `summary.json`."""
        try:
            self.proc.wait(timeout=600)
        finally:
            self.pids()
            self.stop()
        assert self.proc.returncode == 0, self.output()
        return json.loads((self.run_dir / "summary.json").read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:  # let the launcher stop its services before giving up
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def check_restart(summary: dict[str, Any], victim: str, out: str) -> dict[str, Any]:
    """The victim's first restart: it died by SIGKILL, was down a while, came back."""
    first = next((r for r in summary["restarts"] if r["service"] == victim), None)
    assert first is not None, summary["restarts"]
    assert first["exit"] == "signal SIGKILL" and first["exit_code"] == -9, first
    assert first["downtime_seconds"] is not None and first["downtime_seconds"] > 0, first
    assert summary["restarts_total"] == len(summary["restarts"])
    assert f"{victim} died (signal SIGKILL): restarting" in out
    assert f"restart: {victim} (signal SIGKILL), down" in out
    return first


def check_promises(
    run: ChaosRun,
    summary: dict[str, Any],
    *,
    max_lost_puts: int = 0,
    max_lost_steps: int = 0,
) -> None:
    """The promises every fault must keep (see the module docstring)."""
    assert summary["steps"] == STEPS
    assert summary["invariants"]["buffer_accounting"]["ok"], summary["invariants"]
    buffer = summary["buffer"]
    dropped = sum(int(v) for v in (buffer.get("dropped_total") or {}).values())
    assert int(buffer["put_total"]) == (
        int(buffer["acked_total"]) + dropped + int(buffer["pending"]) + int(buffer["in_flight"])
    )
    assert summary["invariants"]["staleness_within_eta"]["ok"], summary["invariants"]

    # Lost work: Redis's lost puts, counted across the buffer's lives.
    assert int(buffer["lost_puts_detected"]) <= max_lost_puts, buffer

    records = jsonl(run.run_dir / "metrics.jsonl")
    steps = [r["step"] for r in records if "step" in r]
    assert len(steps) == len(set(steps)), f"step records written twice: {steps}"
    assert sorted(steps) == list(range(1, STEPS + 1))
    lost = jsonl(run.run_dir / "metrics.lost.jsonl")
    assert len(lost) <= max_lost_steps, lost
    trained = [g for r in records + lost for g in r.get("group_ids", [])]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert max(r["staleness_max"] for r in records + lost) <= ETA

    # The ledger: every group the buffer counts as acknowledged was trained by the live
    # trainer's weights or is named as lost with a dead trainer (metrics.lost.jsonl).
    # A kill between a step's ack and its record (the weights are published in between)
    # leaves one batch acknowledged without a record: the ledger counts it, the file cannot.
    ledger = summary["ledger"]
    lost_groups = sum(len(r.get("group_ids", [])) for r in lost)
    slack = BATCH if max_lost_steps else 0
    assert lost_groups <= ledger["acked_lost_with_crash"] <= lost_groups + slack, (ledger, lost)
    assert ledger["ok"], ledger
    assert ledger["buffer_acked"] == int(buffer["acked_total"]), (ledger, buffer)

    still = {pid for pid, start in run.pids_seen if identity(pid) == (pid, start)}
    left = sorted(still | set(of_run(run.run_dir)))
    assert not left, f"processes of the run left behind: {left}"
