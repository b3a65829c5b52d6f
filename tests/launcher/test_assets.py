"""Port assignment of a local run (`services/launcher/assets.py`, `assign_ports`)."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator

import pytest

from services.common.config import FlywheelConfig
from services.launcher import assets


def _ports(cfg: FlywheelConfig) -> list[int]:
    out: list[int] = []
    for name in ("buffer", "reward", "rollout", "trainer"):
        ep = getattr(cfg.services, name)
        n, stride = (cfg.rollout.n_replicas, ep.port_stride) if name == "rollout" else (1, 1)
        out += [ep.port + stride * i for i in range(n)]
        out += [ep.metrics_port + stride * i for i in range(n)]
    return out


def test_ports_are_distinct_when_the_os_hands_one_out_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A port picked free is not bound until its service starts, so the OS may return it
    # again: a chaos run once got services.reward.port == services.buffer.metrics_port.
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        first, second = a.getsockname()[1], b.getsockname()[1]
    picks: Iterator[int] = itertools.chain([first, first, first, second], itertools.count(40100))
    monkeypatch.setattr(assets, "free_port", lambda: next(picks))
    cfg = FlywheelConfig()
    cfg.rollout.n_replicas = 2
    assets.assign_ports(cfg)
    ports = _ports(cfg)
    assert len(ports) == len(set(ports)) == 10, ports
    assert cfg.services.buffer.port == first and cfg.services.buffer.metrics_port == second


def test_ports_the_config_names_are_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    picks = itertools.chain([41000, 41001, 41001], itertools.count(41100))
    monkeypatch.setattr(assets, "free_port", lambda: next(picks))
    cfg = FlywheelConfig()
    cfg.services.trainer.port = 41000  # the user's choice
    assets.assign_ports(cfg)
    ports = _ports(cfg)
    assert cfg.services.trainer.port == 41000
    assert len(ports) == len(set(ports)), ports
