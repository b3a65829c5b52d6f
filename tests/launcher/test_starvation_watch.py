"""The launcher's starvation watch over a live run: it takes its first snapshot half a
timeout into a wait, names the stage at the timeout (from what a real buffer on loopback
answers; no rollout replica listens), writes `starvation.json`, and forgets it all when a
step comes. The clock is injected and stepped; nothing here waits for time to pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.common.config import FlywheelConfig
from services.launcher.starvation_watch import StarvationWatch

TIMEOUT = 300.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Tail:
    """What the watch reads of `MetricsTail`: the step records seen so far."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.superseded: list[dict[str, Any]] = []


class Trainer:
    def alive(self) -> bool:
        return True


class Watch(StarvationWatch):
    """The real watch with the trainer's phase given (no trainer process here) and its
    snapshots counted; the snapshots themselves ask the real services."""

    phase = "waiting_for_data"
    snapshots = 0

    def trainer_phase(self) -> str | None:
        return self.phase

    def snapshot(self) -> Any:
        self.snapshots += 1
        return super().snapshot()


@pytest.fixture
async def buffer_address(redis_server: Any, tmp_path: Path) -> Any:
    from services.buffer.service import BufferParts, BufferService
    from services.common.config import BufferConfig, RolloutConfig

    svc = BufferService(
        BufferParts(
            buffer=BufferConfig(redis_url=redis_server.url),
            rollout=RolloutConfig(consumer_batch_size=4),
            prefix="starvationwatch",
            export_dir=str(tmp_path / "exports"),
        )
    )
    await svc.start()
    try:
        yield svc.address
    finally:
        await svc.stop(grace=0.5)


def _config(buffer_address: str, free_port: int) -> FlywheelConfig:
    host, port = buffer_address.rsplit(":", 1)
    return FlywheelConfig.model_validate(
        {
            "rollout": {"consumer_batch_size": 4},
            "launcher": {"starvation_timeout_seconds": TIMEOUT},
            "services": {
                "buffer": {"host": host, "port": int(port)},
                "rollout": {"host": "127.0.0.1", "port": free_port},  # nothing listens
            },
        }
    )


async def test_the_watch_names_the_stage_at_the_timeout_and_forgets_on_a_step(
    buffer_address: str, tmp_path: Path, unused_tcp_port: int
) -> None:
    import asyncio

    clock, tail, trainer = Clock(), Tail(), Trainer()
    watch = Watch(_config(buffer_address, unused_tcp_port), tmp_path, None, lambda: True, clock)
    report = tmp_path / "starvation.json"

    def check() -> None:
        watch.check(tail, trainer)  # type: ignore[arg-type]

    # The watch asks with blocking gRPC calls (it runs in the launcher's supervision
    # thread); here they run beside the event loop that serves the buffer.
    async def step(at: float) -> None:
        clock.now = 1000.0 + at
        await asyncio.to_thread(check)

    await step(0.0)  # the first round marks progress (none yet) and starts the wait
    await step(TIMEOUT / 2 - 1)
    assert watch.snapshots == 0 and not report.exists()
    await step(TIMEOUT / 2)
    assert watch.snapshots == 1 and not report.exists()  # the window's first snapshot
    await step(TIMEOUT - 1)
    assert watch.snapshots == 1 and not report.exists()
    await step(TIMEOUT)
    assert watch.snapshots == 2
    record = json.loads(report.read_text())
    assert record["stage"] == "rollout unreachable", record
    assert record["before"]["buffer"]["version"] == "0"  # the real buffer answered

    # A long step is not starvation: the next timeout passes without a verdict.
    report.unlink()
    watch.phase = "training"
    await step(2 * TIMEOUT)
    assert not report.exists() and watch.snapshots == 2

    # A step comes: the wait starts again from it and the old verdict is gone.
    watch.phase = "waiting_for_data"
    report.write_text("{}")
    tail.records.append({"step": 1})
    await step(2 * TIMEOUT + 1)
    assert not report.exists()
    await step(2 * TIMEOUT + 1 + TIMEOUT / 2 - 1)
    assert watch.snapshots == 2
