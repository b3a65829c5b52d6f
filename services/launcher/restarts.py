"""The record of a local run's restarts: each death, its back-off, whether the service came
back, in `<run_dir>/restarts.jsonl` and `summary.json`.

Apart from the supervisor (`local.py`), which decides what to start again and how, because
the record is what an operator reads after the fact: how often, how long down, why killed.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.launcher.processes import RestartBudget, describe_exit


def say(msg: str) -> None:
    """A line of the launcher on the terminal."""
    sys.stderr.write(f"[flywheel] {msg}\n")
    sys.stderr.flush()


@dataclass
class Restart:
    """One death and restart of a service, as `summary.json` and `restarts.jsonl` list it."""

    service: str
    exit: str
    """How it ended: `exit code N` or `signal NAME`."""
    exit_code: int | None
    """The process's return code (negative: killed by that signal)."""
    died_at: float
    """Wall-clock time the launcher saw it dead (within a second of the death)."""
    backoff_seconds: float
    """Wait before the new process was started."""
    restarted_at: float | None = None
    """Wall-clock time the new process was SERVING again (null: the restart failed)."""
    downtime_seconds: float | None = None
    """`restarted_at - died_at`."""
    attempt: int = 0
    """Restarts of this service within the window, this one included."""
    pid: int | None = None
    """Pid of the new process."""
    error: str | None = None
    """Why the restart failed, when it did."""
    reason: str | None = None
    """Why the launcher killed it, when it did (no answer to health checks)."""


class GaveUp(RuntimeError):
    """A service's restart budget is spent."""


@dataclass
class RestartLog:
    """The run's restarts so far, within `launcher.max_restarts` per
    `launcher.restart_window_seconds`."""

    budget: RestartBudget
    run_dir: Path
    max_restarts: int
    window_seconds: float
    records: list[Restart] = field(default_factory=list)
    killed_because: dict[str, str] = field(default_factory=dict)
    """Why the launcher killed a service, kept for its next death's record."""

    def died(self, name: str, code: int | None) -> Restart:
        """Record a death and wait out its back-off; a spent budget raises `GaveUp`."""
        died_at = time.time()
        limit, window = self.max_restarts, self.window_seconds
        delay = self.budget.next_delay(name)
        if delay is None:
            raise GaveUp(
                f"{name} died ({describe_exit(code)}) after {self.budget.recent(name)} "
                f"restarts within {window:.0f}s (launcher.max_restarts={limit})"
            )
        attempt = self.budget.record(name)
        say(
            f"{name} died ({describe_exit(code)}): restarting in {delay:.1f}s "
            f"({attempt}/{limit} within {window:.0f}s)"
        )
        record = Restart(
            name,
            describe_exit(code),
            code,
            died_at,
            delay,
            attempt=attempt,
            reason=self.killed_because.pop(name, None),
        )
        time.sleep(delay)
        return record

    def restarted(self, record: Restart, pid: int | None) -> None:
        """The new process is SERVING."""
        record.restarted_at = time.time()
        record.downtime_seconds = round(record.restarted_at - record.died_at, 3)
        record.pid = pid
        say(
            f"{record.service} is back after {record.downtime_seconds:.1f}s down "
            f"(pid {pid}, restart {record.attempt})"
        )
        self.log(record)

    def failed(self, record: Restart, error: str) -> None:
        """The new process never became healthy; the next round counts another death."""
        record.error = error.splitlines()[0]
        say(f"restart of {record.service} failed: {record.error}")
        self.log(record)

    def log(self, record: Restart) -> None:
        self.records.append(record)
        with open(self.run_dir / "restarts.jsonl", "a") as fh:
            fh.write(json.dumps(asdict(record)) + "\n")
