"""The rollout replica's readiness (services/rollout/service.py): Ready only while it serves
and is not stuck more than eta behind the buffer with nothing newer to load."""

from __future__ import annotations

from types import SimpleNamespace

from services.rollout.service import RolloutService


def test_a_replica_behind_is_not_ready_until_it_catches_up() -> None:
    # The readiness bookkeeping alone: a stand-in for the gRPC server records what the
    # health service would answer (SERVING = True).
    health: list[bool] = []
    svc = RolloutService.__new__(RolloutService)
    svc.server = SimpleNamespace(set_serving=health.append)
    svc._serving = svc._behind = svc._ready = False
    svc._set_serving(True)
    assert svc.ready() and health == [True]
    svc._on_behind(True)  # the loop found it too stale and nothing newer published
    assert not svc.ready() and health[-1] is False
    # a weight update while behind (NOT_SERVING during it, then "serving" again) that left
    # it behind keeps it not ready
    svc._set_serving(False)
    svc._set_serving(True)
    assert not svc.ready() and health[-1] is False
    svc._on_behind(False)  # within eta again
    assert svc.ready() and health[-1] is True
    # while applying weights, catching up does not make it ready early
    svc._set_serving(False)
    svc._on_behind(False)
    assert not svc.ready() and health[-1] is False
