"""Assembles the buffer: Redis client, store, servicer, gRPC server, /metrics, health.

The health monitor is what makes Redis outages survivable without a restart: it pings
Redis (by taking the accounting snapshot the metrics need anyway); while that fails the
service reports NOT_SERVING and RPCs answer UNAVAILABLE, and the first success turns it
SERVING again. redis-py reconnects on its own, and Lua scripts lost by a Redis restart
are reloaded on the NOSCRIPT answer. A Redis that refuses the buffer's password is logged
from the first attempt on (without the password) and shown as
`flywheel_buffer_redis_auth_failed` = 1, while the buffer stays NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.exceptions as redis_errors

from services.buffer.filters import resolve_filter
from services.buffer.metrics import BufferMetrics
from services.buffer.replay import load_replay
from services.buffer.servicer import BufferServicer, ServicerSettings, register
from services.buffer.store import RedisStore, StoreSettings, connect
from services.buffer.validate import MAX_VERSION, max_resume_version
from services.common.aio import stop_task, wait_event
from services.common.codec import CodecLimits
from services.common.config import BufferConfig, FlywheelConfig, RolloutConfig
from services.common.config.services import TLSConfig
from services.common.grpc_server import ServiceServer
from services.common.http_app import MetricsServer
from services.common.metrics import new_registry
from services.common.redis_server import RedisServer

log = logging.getLogger(__name__)

SERVICE_NAME = "flywheel.v1.BufferService"
_UNLIMITED = 1 << 50


def key_prefix(buffer: BufferConfig, experiment: str, trial: str) -> str:
    """All keys of one trial share a Redis Cluster hash tag (`{...}`), so scripts that
    touch several keys stay on one shard."""
    return f"{{{buffer.stream_prefix}:{experiment}:{trial}}}:buf"


def store_settings(
    buffer: BufferConfig,
    rollout: RolloutConfig,
    prefix: str,
    *,
    replay: bool = False,
    max_reply_bytes: int = 60 << 20,
) -> StoreSettings:
    """The store's view of the config; a replay store has its own prefix, no staleness
    check and no storage limits (the file is what it is)."""
    concurrency = rollout.max_concurrent_rollouts or rollout.consumer_batch_size
    return StoreSettings(
        prefix=f"{prefix}:replay" if replay else prefix,
        max_head_offpolicyness=rollout.max_head_offpolicyness,
        consumer_batch_size=rollout.consumer_batch_size,
        max_concurrent_rollouts=concurrency,
        queue_size=rollout.queue_size or 16 * concurrency,
        max_stored_groups=_UNLIMITED if replay else buffer.max_stored_groups,
        max_stored_bytes=_UNLIMITED if replay else buffer.max_stored_bytes,
        claim_idle_ms=buffer.claim_idle_ms,
        reservation_ttl_ms=int(buffer.reservation_timeout_s * 1000),
        tombstone_ttl_s=buffer.tombstone_ttl_s,
        request_id_ttl_s=buffer.request_id_ttl_s,
        retain_acked_groups=buffer.retain_acked_groups,
        max_reply_bytes=max_reply_bytes,
        staleness_check=not replay,
    )


def redis_password(buffer: BufferConfig) -> str | None:
    return buffer.redis_password or os.environ.get("FLYWHEEL_REDIS_PASSWORD") or None


@dataclass
class BufferParts:
    """Everything the buffer needs, without the rest of the experiment's config."""

    buffer: BufferConfig
    rollout: RolloutConfig
    prefix: str
    export_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    auth_token: str | None = None
    max_message_bytes: int = 64 << 20
    credentials: dict[str, str] | None = None  # None: from the environment
    tls: TLSConfig | None = None  # None: from the environment
    local_redis_dir: str | None = None
    max_resume_version: int = MAX_VERSION  # `buffer.max_resume_version`, resolved

    @classmethod
    def from_config(cls, cfg: FlywheelConfig) -> BufferParts:
        run_dir = Path(cfg.cluster.fileroot) / cfg.experiment_name / cfg.trial_name
        ep = cfg.services.buffer
        return cls(
            buffer=cfg.buffer,
            rollout=cfg.rollout,
            prefix=key_prefix(cfg.buffer, cfg.experiment_name, cfg.trial_name),
            export_dir=cfg.buffer.export_dir or str(run_dir / "buffer_exports"),
            host=ep.host,
            port=ep.port,
            metrics_port=ep.metrics_port,
            auth_token=cfg.services.auth_token,
            max_message_bytes=cfg.services.max_message_bytes,
            credentials=cfg.services.credentials,
            tls=cfg.services.tls,
            local_redis_dir=str(run_dir / "redis"),
            max_resume_version=max_resume_version(
                cfg.buffer.max_resume_version, cfg.total_train_steps
            ),
        )


class BufferService:
    """The running buffer. `await start()`, then `port`/`metrics_port`; `await stop()`."""

    def __init__(self, parts: BufferParts) -> None:
        self.parts = parts
        b = parts.buffer
        self.replay_path = b.replay_path
        self.local_redis: RedisServer | None = None
        self.registry = new_registry()
        self.metrics = BufferMetrics(self.registry)
        self.metrics.max_head_offpolicyness.set(parts.rollout.max_head_offpolicyness)
        self.group_filter = resolve_filter(b.filter)
        self.store: RedisStore | None = None
        self.servicer: BufferServicer | None = None
        self.server = ServiceServer(
            "buffer",
            host=parts.host,
            port=parts.port,
            max_message_bytes=parts.max_message_bytes,
            auth_token=parts.auth_token,
            service_names=[SERVICE_NAME],
            credentials=parts.credentials,
            tls=parts.tls,
            auth_metrics=self.metrics.auth,
        )
        self.http = MetricsServer(
            "buffer",
            self.registry,
            ready=lambda: self.redis_ok,
            host=parts.host,
            port=parts.metrics_port,
        )
        self.redis_ok = False
        self._redis_problem: str | None = None  # the kind of failure last logged
        self._monitor: asyncio.Task[None] | None = None
        self._wake_monitor = asyncio.Event()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def metrics_port(self) -> int:
        return self.http.port

    @property
    def address(self) -> str:
        return f"{self.parts.host}:{self.server.port}"

    def _redis_url(self) -> str:
        b = self.parts.buffer
        if b.redis_url:
            return b.redis_url
        # Standalone convenience: the launcher normally starts Redis and fills redis_url in.
        self.local_redis = RedisServer(
            dir=self.parts.local_redis_dir, password=redis_password(b), binary=b.redis_server
        ).start()
        log.info("started a local redis-server", extra={"url_port": self.local_redis.port})
        return self.local_redis.url

    async def start(self) -> None:
        p = self.parts
        b = p.buffer
        client = connect(self._redis_url(), redis_password(b))
        settings = store_settings(
            b,
            p.rollout,
            p.prefix,
            replay=bool(self.replay_path),
            max_reply_bytes=p.max_message_bytes - (1 << 20),
        )
        self.store = RedisStore(client, settings)
        self.servicer = BufferServicer(
            self.store,
            self.metrics,
            ServicerSettings(
                max_group_bytes=b.max_group_bytes,
                codec_limits=CodecLimits(),
                retry_after_ms=b.retry_after_ms,
                claim_poll_ms=b.claim_poll_ms,
                export_dir=p.export_dir,
                filter_name=b.filter or "",
                filter_at=b.filter_at,
                max_head_offpolicyness=p.rollout.max_head_offpolicyness,
                replay=bool(self.replay_path),
                tokenizer_path=b.tokenizer_path,
                read_cache_bytes=b.read_cache_bytes,
                max_resume_version=p.max_resume_version,
            ),
            group_filter=self.group_filter,
            on_redis_error=self._on_redis_error,
        )
        register(self.servicer, self.server.server)
        if self.replay_path:
            await self._wait_for_redis()
            n = await load_replay(self.store, self.replay_path)
            log.info("replaying an exported file", extra={"path": self.replay_path, "groups": n})
        await self._check_redis()
        await self.server.start()
        self.server.set_serving(self.redis_ok)
        self.http.start()
        self._monitor = asyncio.create_task(self._monitor_redis(), name="buffer-redis-monitor")
        log.info(
            "buffer serving",
            extra={
                "address": self.address,
                "metrics_port": self.metrics_port,
                "prefix": settings.prefix,
            },
        )

    async def _wait_for_redis(self, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not await self._check_redis():
            if loop.time() > deadline:
                raise TimeoutError(f"redis not reachable after {timeout:.0f}s")
            await asyncio.sleep(0.2)

    async def _check_redis(self) -> bool:
        assert self.store is not None and self.servicer is not None
        try:
            await self.servicer.snapshot()
        except Exception as err:  # any failure means "not usable now"
            self._redis_failed(err)
            return False
        if not self.redis_ok:
            log.info("redis reachable: SERVING")
            await self._warn_without_aof()
        self._redis_problem = None
        self.metrics.redis_auth_failed.set(0)
        self._set_redis_ok(True)
        return True

    def _redis_failed(self, err: Exception) -> None:
        """Count a failed check; log it when the kind of failure is new (the first check
        included), so a Redis that refuses the buffer from the start is not silent."""
        auth = isinstance(err, redis_errors.AuthenticationError | redis_errors.AuthorizationError)
        problem = "auth" if auth else "unreachable"
        if problem != self._redis_problem:
            if auth:
                log.error(
                    "redis refuses the buffer's credentials: NOT_SERVING; check "
                    "buffer.redis_password / FLYWHEEL_REDIS_PASSWORD (or the password in "
                    "buffer.redis_url) against Redis's requirepass",
                    extra={"error": type(err).__name__},
                )
            else:
                log.error("redis unreachable: NOT_SERVING", extra={"error": str(err)})
        self._redis_problem = problem
        self.metrics.redis_auth_failed.set(1 if auth else 0)
        self.metrics.redis_errors.inc()
        self._set_redis_ok(False)

    async def _warn_without_aof(self) -> None:
        assert self.store is not None
        try:
            conf: dict[Any, Any] = await self.store.redis.config_get("appendonly")
        except Exception:  # managed Redis often forbids CONFIG
            return
        value = conf.get(b"appendonly", conf.get("appendonly"))
        if value in (b"no", "no"):
            log.warning("redis runs without AOF: a Redis crash loses every stored group")

    def _set_redis_ok(self, ok: bool) -> None:
        self.metrics.redis_up.set(1 if ok else 0)
        if ok != self.redis_ok:
            self.redis_ok = ok
            if self.server.port:
                self.server.set_serving(ok)

    def _on_redis_error(self, err: BaseException) -> None:
        self._set_redis_ok(False)
        self._wake_monitor.set()

    async def _monitor_redis(self) -> None:
        interval = self.parts.buffer.health_check_interval_s
        while True:
            await wait_event(self._wake_monitor, interval)
            self._wake_monitor.clear()
            await self._check_redis()

    async def stop(self, grace: float = 2.0) -> None:
        if self._monitor is not None:
            await stop_task(self._monitor)  # not one cancel: redis-py can lose it (aio.py)
        await self.server.stop(grace)
        self.http.stop()
        if self.store is not None:
            await self.store.close()
        if self.local_redis is not None:
            self.local_redis.stop()
