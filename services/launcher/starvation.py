"""Starvation watchdog: when the trainer has waited for data too long, say which stage holds
the run, with the numbers that show it.

The launcher takes a snapshot of what the services report (the buffer's ledger and capacity,
each rollout replica's counters, whether reward answers) when the wait passes half of
`launcher.starvation_timeout_seconds`, another when it passes the whole, and compares them.
The first matching stage, in the order of the data's path back from the trainer, is named:

1. `buffer unreachable`: no answer from the buffer.
2. `trainer not claiming`: a batch is pending; the data is there, the trainer does not take it.
3. `rollout unreachable`: no replica answers.
4. `rollout paused`: every replica that answers is paused or draining.
5. `everything dropped`: groups arrived but were all dropped (stale, filtered, invalid).
6. `reward holds`: the reward service is down, or replicas have requests in flight and
   finish no group (their reservations may be what keeps the capacity at zero).
7. `no capacity`: the buffer grants the rollout nothing (the staleness or concurrency term of
   the capacity formula is at zero), nothing is in flight and nothing arrives.
8. `rollout not generating`: capacity is free, nothing is in flight, nothing is produced.
9. `too slow`: groups arrive, only fewer than a batch in the window.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Snapshot:
    """What the services reported at one moment (None: that service did not answer)."""

    at: float
    buffer: dict[str, Any] | None
    rollouts: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    reward_up: bool = True


def _int(stats: dict[str, Any] | None, key: str) -> int:
    return int((stats or {}).get(key, 0) or 0)


def _dropped(stats: dict[str, Any] | None) -> dict[str, int]:
    return {k: int(v) for k, v in ((stats or {}).get("dropped_total") or {}).items()}


def diagnose(before: Snapshot, now: Snapshot, *, batch: int, waited_s: float) -> dict[str, Any]:
    """The stage that holds the run, a sentence with its numbers, and the numbers."""
    window = max(now.at - before.at, 0.0)
    b = now.buffer
    numbers: dict[str, Any] = {"waited_s": round(waited_s, 1), "window_s": round(window, 1)}

    def verdict(stage: str, detail: str) -> dict[str, Any]:
        return {"stage": stage, "detail": detail, "numbers": numbers, "at": time.time()}

    if b is None:
        return verdict("buffer unreachable", "the buffer does not answer Stats")
    pending, capacity = _int(b, "pending"), _int(b, "capacity")
    put = _int(b, "put_total") - _int(before.buffer, "put_total")
    drop_now, drop_then = _dropped(b), _dropped(before.buffer)
    dropped = {k: v - drop_then.get(k, 0) for k, v in drop_now.items() if v > drop_then.get(k, 0)}
    answering = {k: v for k, v in now.rollouts.items() if v is not None}
    in_flight = sum(_int(v, "requests_in_flight") for v in answering.values())
    produced = sum(
        _int(v, "groups_produced") - _int(before.rollouts.get(k), "groups_produced")
        for k, v in answering.items()
    )
    numbers.update(
        pending=pending,
        batch=batch,
        capacity=capacity,
        version=_int(b, "version"),
        accepted=_int(b, "accepted"),
        running=_int(b, "running"),
        put_in_window=put,
        dropped_in_window=dropped,
        replicas_answering=f"{len(answering)}/{len(now.rollouts)}",
        requests_in_flight=in_flight,
        groups_produced_in_window=produced,
        reward_up=now.reward_up,
    )
    if pending >= batch:
        return verdict("trainer not claiming", f"{pending} groups pending >= a batch of {batch}")
    if not answering:
        return verdict("rollout unreachable", "no rollout replica answers Stats")
    if all(v.get("paused") or v.get("draining") for v in answering.values()):
        return verdict("rollout paused", "every replica that answers is paused or draining")
    if put > 0 and sum(dropped.values()) >= put:
        return verdict(
            "everything dropped",
            f"{put} groups put, {sum(dropped.values())} dropped ({dropped}) in {window:.0f}s",
        )
    if not now.reward_up or (in_flight > 0 and produced == 0):
        return verdict(
            "reward holds",
            "the reward service does not answer"
            if not now.reward_up
            else f"{in_flight} requests in flight, no group finished in {window:.0f}s",
        )
    if capacity <= 0 and put == 0:
        return verdict(
            "no capacity",
            f"capacity {capacity} at version {numbers['version']} (accepted "
            f"{numbers['accepted']}, running {numbers['running']}): the staleness or "
            "concurrency gate is closed and nothing arrives",
        )
    if in_flight == 0 and produced == 0:
        return verdict(
            "rollout not generating",
            f"capacity {capacity} free, nothing in flight, nothing produced in {window:.0f}s",
        )
    return verdict(
        "too slow",
        f"{put} groups put in {window:.0f}s, {pending} pending, a batch is {batch}",
    )


def as_record(before: Snapshot, now: Snapshot, verdict: dict[str, Any]) -> dict[str, Any]:
    """The verdict with both snapshots, as written to `starvation.json`."""
    return {**verdict, "before": asdict(before), "now": asdict(now)}
