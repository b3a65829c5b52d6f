"""Chaos: a real `flywheel run` survives each fault, one short run per fault,
and keeps the promises of the design (`tests/chaos/harness.py` lists them and checks them
for every fault).

Faults: SIGKILL of the buffer, of the reward service, of a rollout replica, of the trainer
(after a checkpoint) and of the local redis-server (AOF `everysec`); SIGSTOP of the reward
service for longer than its deadline (the launcher's liveness probe finds it silent, kills
and restarts it). Each comes at a random moment once the trainer has made a step.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.chaos.harness import (
    LIVENESS_S,
    REWARD_DEADLINE_MS,
    SAVE_FREQ,
    ChaosRun,
    check_promises,
    check_restart,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("victim", ["buffer", "reward", "rollout-0"])
def test_kill_9_of_a_stateless_service_loses_nothing(tmp_path: Path, victim: str) -> None:
    """The buffer's state is in Redis, the reward service's in no one's (the rollout scores
    the group again), a replica's groups already put are in the buffer and its reservations
    are released by the new process: none of the three can lose work."""
    run = ChaosRun(tmp_path)
    try:
        run.inject(victim, signal.SIGKILL)
        run.wait_restarted(victim)
        summary = run.finish()
    finally:
        run.stop()
    first = check_restart(summary, victim, run.output())
    assert first["reason"] is None  # it died; the launcher did not kill it
    check_promises(run, summary)


def test_kill_9_of_the_trainer_loses_at_most_its_checkpoint_interval(tmp_path: Path) -> None:
    """The restarted trainer resumes from its last checkpoint: the steps after it are lost
    (at most `save_freq_steps`, moved to `metrics.lost.jsonl`, trained again on new groups),
    and the groups they acknowledged are counted in the ledger, never trained twice."""
    run = ChaosRun(tmp_path)
    try:
        run.inject("trainer", signal.SIGKILL, after_checkpoint=True)
        run.wait_restarted("trainer")
        summary = run.finish()
    finally:
        run.stop()
    check_restart(summary, "trainer", run.output())
    check_promises(run, summary, max_lost_steps=SAVE_FREQ)
    assert summary["ledger"]["resumes"] >= 1, summary["ledger"]


def test_kill_9_of_redis_loses_at_most_the_last_seconds_puts(tmp_path: Path) -> None:
    """Redis restarts from its append-only file, fsynced every second: at most the puts of
    the last second are lost (Redis postpones a late fsync by up to another second, hence
    two; Linux keeps every write a killed process made, so usually none). The buffer counts
    any loss, and the count reaches `summary.json` across the buffer's lives."""
    run = ChaosRun(tmp_path)
    try:
        fault = run.inject("redis-server", signal.SIGKILL)
        run.wait_restarted("redis-server")
        summary = run.finish()
    finally:
        run.stop()
    check_restart(summary, "redis-server", run.output())
    # The samples end just before the kill; a put between the last one and the kill is
    # bounded by the rollouts in flight (rollout.max_concurrent_rollouts, 8).
    # Redis 6.2 counts its 2 s postponement in whole seconds of a cached clock, until its
    # next flush attempt: the puts of the 3 s before (here all that were sampled) bound it.
    bound = fault.puts_within(3.0) + 8
    check_promises(run, summary, max_lost_puts=bound)


def test_sigstop_of_reward_past_its_deadline_is_killed_and_restarted(tmp_path: Path) -> None:
    """A reward service that stops answering (SIGSTOP) outlasts its deadline
    (`reward.deadline_ms`); the launcher's liveness probe finds it silent for
    `launcher.liveness_timeout_seconds`, kills it and starts it again."""
    assert LIVENESS_S * 1000 > REWARD_DEADLINE_MS
    run = ChaosRun(tmp_path, liveness_s=LIVENESS_S)
    try:
        run.inject("reward", signal.SIGSTOP)
        run.wait_restarted("reward")
        summary = run.finish()
    finally:
        run.stop()
    hung = check_restart(summary, "reward", run.output())
    assert "no answer to its health check" in hung["reason"], hung
    check_promises(run, summary)
