"""The record of a run's restarts (services/launcher/restarts.py): what an operator reads in
`<run_dir>/restarts.jsonl` after the fact.

Exit descriptions are held to Python's `signal` module (POSIX signal numbers: a process
Popen reports as -9 died of SIGKILL); the back-off to `RestartBudget`'s documented
`min(backoff_max_s, backoff_s * 2**n)`, on an injected clock so that no test waits.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict
from pathlib import Path

import pytest

from services.launcher.processes import RestartBudget
from services.launcher.restarts import GaveUp, Restart, RestartLog


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def restart_log(tmp_path: Path, clock: Clock, *, max_restarts: int = 2) -> RestartLog:
    # backoff 0: `died` waits out min(0, 0 * 2**n) = 0 s, so the test does not sleep
    budget = RestartBudget(max_restarts, 60.0, 0.0, 0.0, clock=clock)
    return RestartLog(budget, tmp_path, max_restarts, 60.0)


def lines(tmp_path: Path) -> list[dict]:
    text = (tmp_path / "restarts.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_a_death_and_its_restart_are_one_line_of_restarts_jsonl(tmp_path: Path) -> None:
    log = restart_log(tmp_path, Clock())
    log.killed_because["buffer"] = "no answer to its health check for 30s"
    record = log.died("buffer", -signal.SIGKILL)
    assert record.exit == f"signal {signal.Signals.SIGKILL.name}" == "signal SIGKILL"
    assert record.exit_code == -9
    assert record.attempt == 1 and record.backoff_seconds == 0.0
    assert record.reason == "no answer to its health check for 30s"
    assert "buffer" not in log.killed_because  # the reason belongs to this death only
    log.restarted(record, pid=4242)
    assert record.restarted_at is not None and record.downtime_seconds is not None
    assert record.downtime_seconds == pytest.approx(record.restarted_at - record.died_at, abs=1e-3)
    (line,) = lines(tmp_path)
    assert line == asdict(record)
    assert line["pid"] == 4242 and line["error"] is None
    assert set(line) == {f for f in Restart.__dataclass_fields__}


def test_a_failed_restart_keeps_the_first_line_of_its_error(tmp_path: Path) -> None:
    log = restart_log(tmp_path, Clock())
    record = log.died("reward", 3)
    assert record.exit == "exit code 3" and record.reason is None
    log.failed(record, "reward did not become SERVING in 60s\nlast log lines:\n...")
    (line,) = lines(tmp_path)
    assert line["error"] == "reward did not become SERVING in 60s"
    assert line["restarted_at"] is None and line["pid"] is None
    assert log.records == [record]


def test_the_budget_is_per_service_and_per_window(tmp_path: Path) -> None:
    clock = Clock()
    log = restart_log(tmp_path, clock, max_restarts=2)
    assert [log.died("trainer", 1).attempt for _ in range(2)] == [1, 2]
    assert log.died("rollout-0", 1).attempt == 1  # another service has its own budget
    with pytest.raises(GaveUp) as err:
        log.died("trainer", -signal.SIGTERM)
    assert str(err.value) == (
        "trainer died (signal SIGTERM) after 2 restarts within 60s (launcher.max_restarts=2)"
    )
    clock.now += 60.0  # both restarts leave the window: the budget is whole again
    assert log.died("trainer", 1).attempt == 1


def test_the_backoff_doubles_up_to_its_cap() -> None:
    clock = Clock()
    budget = RestartBudget(5, 600.0, 0.5, 3.0, clock=clock)
    delays = []
    for _ in range(5):
        delays.append(budget.next_delay("buffer"))
        budget.record("buffer")
    # min(3.0, 0.5 * 2**n) for n = 0..4
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert budget.next_delay("buffer") is None
