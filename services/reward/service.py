"""Assembles the reward service: registry, worker pool, servicer, gRPC server, /metrics.

Start order matters for readiness: the workers start (and import and warm up the
verifiers) before the gRPC server reports SERVING, so the first ScoreBatch a rollout
sends is not charged with sympy's import time. Stop order is the reverse: NOT_SERVING,
drain in-flight RPCs, then kill the workers.

Readiness has one definition, `ready()`: not stopping and at least one worker up. Both
`/readyz` and the gRPC health follow it; the pool reports each change, so health turns
NOT_SERVING while no worker can start (or the only one is being replaced) and SERVING
again once one is up. A liveness probe that only asks for an answer is not affected.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flywheel_proto.v1 import reward_pb2_grpc
from services.common.config import FlywheelConfig, RewardConfig
from services.common.config.services import TLSConfig
from services.common.grpc_server import ServiceServer
from services.common.http_app import MetricsServer
from services.common.metrics import new_registry
from services.reward.metrics import RewardMetrics
from services.reward.pool import PoolConfig, WorkerPool
from services.reward.process import enable_subreaper
from services.reward.registry import BUILTINS, RewardRegistry
from services.reward.servicer import RewardServicer

log = logging.getLogger(__name__)

SERVICE_NAME = "flywheel.v1.RewardService"


@dataclass
class RewardParts:
    """What the reward service needs from the experiment's config."""

    reward: RewardConfig
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = 0  # None: no HTTP side app (tests that only need gRPC)
    auth_token: str | None = None
    max_message_bytes: int = 64 << 20
    credentials: dict[str, str] | None = None  # None: from the environment
    tls: TLSConfig | None = None  # None: from the environment

    @classmethod
    def from_config(cls, cfg: FlywheelConfig) -> RewardParts:
        ep = cfg.services.reward
        return cls(
            reward=cfg.reward,
            host=ep.host,
            port=ep.port,
            metrics_port=ep.metrics_port,
            auth_token=cfg.services.auth_token,
            max_message_bytes=cfg.services.max_message_bytes,
            credentials=cfg.services.credentials,
            tls=cfg.services.tls,
        )


def pool_config(reward: RewardConfig, registry: RewardRegistry) -> PoolConfig:
    """Workers preload every registered function and warm up the default built-in (a
    user function is never called just to warm it: it may have side effects)."""
    default_path = registry.default.path
    return PoolConfig(
        num_workers=reward.num_workers,
        max_queue=reward.max_queue,
        max_chunk=reward.chunk_size,
        memory_bytes=(reward.worker_memory_mb or 0) << 20,
        cpu_seconds=float(reward.worker_cpu_seconds or 0),
        start_timeout_s=reward.worker_start_timeout_s,
        preload=tuple(sorted(set(registry.paths().values()) | {default_path})),
        warmup=(default_path,) if default_path in BUILTINS.values() else (),
    )


class RewardService:
    """The running reward service. `await start()`, then `port` / `address`; `await stop()`."""

    def __init__(self, parts: RewardParts) -> None:
        self.parts = parts
        r = parts.reward
        self.registry = RewardRegistry(
            r.functions, default=r.fn, allow_dotted_paths=r.allow_dotted_paths
        )
        self.prom = new_registry()
        self.metrics = RewardMetrics(self.prom)
        self.pool = WorkerPool(pool_config(r, self.registry), self.metrics)
        self.pool.on_ready_change = self._workers_changed
        self.servicer = RewardServicer(r, self.registry, self.pool, self.metrics)
        self.server = ServiceServer(
            "reward",
            host=parts.host,
            port=parts.port,
            max_message_bytes=parts.max_message_bytes,
            auth_token=parts.auth_token,
            service_names=[SERVICE_NAME],
            credentials=parts.credentials,
            tls=parts.tls,
            auth_metrics=self.metrics.auth,
        )
        reward_pb2_grpc.add_RewardServiceServicer_to_server(self.servicer, self.server.server)
        self.http: MetricsServer | None = None
        if parts.metrics_port is not None:
            self.http = MetricsServer(
                "reward", self.prom, ready=self.ready, host=parts.host, port=parts.metrics_port
            )
        self._stopping = False

    def ready(self) -> bool:
        return not self._stopping and self.pool.ready_workers > 0

    def _workers_changed(self, _any_ready: bool) -> None:
        self.server.set_serving(self.ready())

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def metrics_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    @property
    def address(self) -> str:
        return f"{self.parts.host}:{self.server.port}"

    async def start(self) -> int:
        await self.pool.start(wait_ready=True)
        if self.http is not None:
            self.http.start()
        port = await self.server.start()
        self.server.set_serving(self.ready())  # start() says SERVING; a worker may have died
        log.info(
            "reward service serving",
            extra={
                "address": self.address,
                "fn": self.registry.default.name,
                "workers": self.pool.ready_workers,
            },
        )
        return port

    async def stop(self, grace: float = 5.0) -> None:
        self._stopping = True
        await self.server.stop(grace)
        await self.pool.close()
        if self.http is not None:
            self.http.stop()

    async def serve_forever(self) -> None:
        """Run until SIGTERM/SIGINT, then drain and stop.

        The process that serves forever is the reward service's own, whose only children
        are its workers: it becomes their subreaper, so whatever a worker that died on its
        own had started is killed and reaped too (`services.reward.reaper`)."""
        enable_subreaper()
        await self.start()
        self.server.install_signal_handlers()
        await self.server.wait_for_termination()
        await self.stop()
