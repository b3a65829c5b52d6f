"""The starvation watchdog names the stage that holds a waiting trainer, from what the
services report at the start and end of a window (hand-built reports, one per stage)."""

from __future__ import annotations

from typing import Any

import pytest

from services.launcher.starvation import Snapshot, diagnose

BATCH = 4


def _buffer(**kw: Any) -> dict[str, Any]:
    # As MessageToDict renders BufferStats: int64 fields are strings.
    base = {
        "version": "5",
        "put_total": "40",
        "acked_total": "36",
        "pending": "0",
        "in_flight": "0",
        "capacity": "4",
        "accepted": "0",
        "running": "0",
        "dropped_total": {},
    }
    return {**base, **{k: (str(v) if isinstance(v, int) else v) for k, v in kw.items()}}


def _replica(**kw: Any) -> dict[str, Any]:
    base = {"requests_in_flight": "0", "groups_produced": "40", "paused": False, "draining": False}
    return {**base, **{k: (str(v) if isinstance(v, int) else v) for k, v in kw.items()}}


def _stage(before: Snapshot, now: Snapshot) -> str:
    return str(diagnose(before, now, batch=BATCH, waited_s=300.0)["stage"])


def _snap(at: float, buffer: dict | None, replica: dict | None, reward_up: bool = True):
    return Snapshot(at, buffer, {"rollout-0": replica}, reward_up)


T0 = _snap(0.0, _buffer(), _replica())


@pytest.mark.parametrize(
    ("now", "stage"),
    [
        (_snap(150.0, None, _replica()), "buffer unreachable"),
        (_snap(150.0, _buffer(pending=4), _replica()), "trainer not claiming"),
        (_snap(150.0, _buffer(), None), "rollout unreachable"),
        (_snap(150.0, _buffer(), _replica(paused=True)), "rollout paused"),
        # 6 put (40 -> 46), all 6 dropped as stale at put.
        (
            _snap(
                150.0,
                _buffer(put_total=46, dropped_total={"stale_at_put": "6"}),
                _replica(groups_produced=46),
            ),
            "everything dropped",
        ),
        # (eta + v + 1) * batch - (accepted + running) = 0: the staleness gate is closed.
        (_snap(150.0, _buffer(capacity=0, accepted=12), _replica()), "no capacity"),
        # Capacity 0 only because 4 reservations are held by requests that never finish.
        (
            _snap(150.0, _buffer(capacity=0, running=4), _replica(requests_in_flight=4)),
            "reward holds",
        ),
        (_snap(150.0, _buffer(running=4), _replica(requests_in_flight=4)), "reward holds"),
        (_snap(150.0, _buffer(), _replica(), reward_up=False), "reward holds"),
        (_snap(150.0, _buffer(), _replica()), "rollout not generating"),
        (_snap(150.0, _buffer(put_total=42, pending=2), _replica(groups_produced=42)), "too slow"),
    ],
)
def test_the_stage_that_holds_the_run_is_named(now: Snapshot, stage: str) -> None:
    assert _stage(T0, now) == stage


def test_the_verdict_carries_the_numbers_that_show_it() -> None:
    now = _snap(
        150.0,
        _buffer(put_total=46, dropped_total={"stale_at_put": "6"}),
        _replica(groups_produced=46),
    )
    verdict = diagnose(T0, now, batch=BATCH, waited_s=301.0)
    n = verdict["numbers"]
    assert (n["put_in_window"], n["dropped_in_window"]) == (6, {"stale_at_put": 6})
    assert (n["groups_produced_in_window"], n["window_s"], n["waited_s"]) == (6, 150.0, 301.0)
    assert "6 groups put, 6 dropped" in verdict["detail"]
