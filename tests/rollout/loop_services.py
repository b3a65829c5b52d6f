"""The services a rollout loop talks to, on loopback: a real buffer (on the test's real
redis-server) and a real reward service, with a client of each and a trainer-side buffer
client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class LoopServices:
    buffer: Any
    """The rollout's `BufferClient`."""
    trainer_side: Any
    """A second `BufferClient`, claiming and acknowledging as the trainer does."""
    reward: Any
    """A `RewardClient`."""


@asynccontextmanager
async def loop_services(
    redis_url: str, tmp_path: Path, *, fn: str, eta: int = 1, prefix: str = "rollouttest"
) -> AsyncIterator[LoopServices]:
    """Start the buffer (consumer batch 2, staleness `eta`) and the reward service (`fn`, one
    worker); stop both after the block."""
    from services.buffer.client import BufferClient
    from services.buffer.service import BufferParts, BufferService
    from services.common.config import BufferConfig, RewardConfig, RolloutConfig
    from services.reward.client import RewardClient
    from services.reward.service import RewardParts, RewardService

    buffer_svc = BufferService(
        BufferParts(
            buffer=BufferConfig(redis_url=redis_url, claim_poll_ms=5),
            rollout=RolloutConfig(consumer_batch_size=2, max_head_offpolicyness=eta),
            prefix=prefix,
            export_dir=str(tmp_path / "exports"),
        )
    )
    await buffer_svc.start()
    reward_svc = RewardService(
        RewardParts(reward=RewardConfig(fn=fn, num_workers=1), metrics_port=None)
    )
    await reward_svc.start()
    clients = LoopServices(
        BufferClient(buffer_svc.address),
        BufferClient(buffer_svc.address),
        RewardClient(reward_svc.address),
    )
    try:
        yield clients
    finally:
        for c in (clients.buffer, clients.trainer_side, clients.reward):
            await c.close()
        await reward_svc.stop(grace=0.5)
        await buffer_svc.stop(grace=0.5)
