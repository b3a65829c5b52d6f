"""Assemble one trainer rank: process group, model, and (rank 0) the service around it.

Every rank builds the `PPOTrainer` and runs the `TrainerLoop`. Global rank 0 also owns:
the I/O loop, the buffer client, the weight publisher, the control state and the gRPC
`TrainerService`. The local rank 0 of every node serves grpc.health.v1 and the HTTP side
app (`/healthz`, `/readyz`, `/metrics`) on the configured ports, so probes work on every
node: its health answers for `flywheel.v1.TrainerService` too (the name a Kubernetes
probe asks for), although only global rank 0 serves the RPCs. Health turns SERVING once
that node's model is loaded and any checkpoint restored. Only rank 0's `/metrics` carries
the trainer's series; the other nodes' is empty (they compute no statistics).
"""

from __future__ import annotations

import logging
import signal
import traceback
from typing import Any

from prometheus_client import CollectorRegistry, write_to_textfile

from flywheel_proto.v1 import trainer_pb2_grpc
from services.common.config import FlywheelConfig
from services.common.grpc_server import ServiceServer
from services.common.http_app import MetricsServer
from services.trainer.control import Control
from services.trainer.dist import DistContext, init_distributed
from services.trainer.io_loop import IOLoop
from services.trainer.loop import TrainerLoop
from services.trainer.metrics import TrainerMetrics
from services.trainer.parity import PARITY_FILE, ParityProbe
from services.trainer.paths import RunPaths
from services.trainer.ppo import PPOTrainer
from services.trainer.servicer import SERVICE_NAME, TrainerServicer
from services.trainer.weight_sync import WeightPublisher
from services.wire.buffer_client import BufferClient

log = logging.getLogger(__name__)


class TrainerService:
    """One rank's service parts; `run()` returns the exit code."""

    def __init__(self, cfg: FlywheelConfig, ctx: DistContext | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx or init_distributed(cfg.trainer.device)
        self.paths = RunPaths.from_config(cfg)
        self.control = Control(
            total_train_steps=cfg.total_train_steps, world_size=self.ctx.world_size
        )
        self.metrics = TrainerMetrics() if self.ctx.is_main else None
        self.io: IOLoop | None = None
        self.server: ServiceServer | None = None
        self.http: MetricsServer | None = None
        self.buffer: BufferClient | None = None
        self.publisher: WeightPublisher | None = None
        self._ready = False

    # -- network side ------------------------------------------------------------------------
    def _start_network(self) -> None:
        local_main = int(self.ctx.local_rank) == 0
        if not (self.ctx.is_main or local_main):
            return
        ep = self.cfg.services.trainer
        registry = self.metrics.registry if self.metrics is not None else CollectorRegistry()
        self.http = MetricsServer(
            "trainer", registry, lambda: self._ready, ep.host, ep.metrics_port
        )
        self.http.start()
        self.io = IOLoop()
        # Every node answers health for the service name: a probe asks each pod for it.
        names = [SERVICE_NAME]

        async def start_grpc() -> int:
            self.server = ServiceServer(
                "trainer",
                host=ep.host,
                port=ep.port,
                max_message_bytes=self.cfg.services.max_message_bytes,
                auth_token=self.cfg.services.auth_token,
                service_names=names,
                credentials=self.cfg.services.credentials,
                tls=self.cfg.services.tls,
                auth_metrics=self.metrics.auth if self.metrics is not None else None,
            )
            if self.ctx.is_main:
                trainer_pb2_grpc.add_TrainerServiceServicer_to_server(
                    TrainerServicer(self.control), self.server.server
                )
            port = await self.server.start()
            self.server.set_serving(False)  # SERVING once the model is ready
            return port

        port = self.io.run(start_grpc(), timeout=30)
        log.info("trainer endpoints", extra={"grpc_port": port, "metrics_port": self.http.port})
        if self.ctx.is_main:
            s = self.cfg.services

            async def make_clients() -> tuple[BufferClient, WeightPublisher]:
                # gRPC aio channels belong to the loop they are created on.
                peers = self.metrics.peers if self.metrics is not None else None
                buffer = BufferClient(
                    s.buffer.address,
                    auth_token=s.auth_token,
                    max_message_bytes=s.max_message_bytes,
                    outage_budget_s=s.peer_outage_budget_s,
                    peer=peers.peer("buffer", s.buffer.address) if peers is not None else None,
                    tls=s.tls,
                )
                parity = (
                    ParityProbe.from_config(
                        self.cfg,
                        log_path=self.paths.run_dir / PARITY_FILE,
                        metrics=self.metrics,
                    )
                    if self.cfg.trainer.parity_probe_freq
                    else None
                )
                publisher = WeightPublisher(
                    self.cfg, weight_dir=self.paths.weight_dir, peers=peers, parity=parity
                )
                return buffer, publisher

            self.buffer, self.publisher = self.io.run(make_clients(), timeout=30)

    def _set_ready(self, ready: bool) -> None:
        self._ready = ready
        if self.server is not None and self.io is not None:
            server = self.server

            async def flip() -> None:
                server.set_serving(ready)

            self.io.run(flip(), timeout=10)

    def _install_signals(self) -> None:
        """SIGTERM/SIGINT on rank 0: stop after the current step. Other ranks follow rank
        0's stop command; a signal there is ignored (leaving mid-collective would hang
        the others)."""

        def handler(signum: int, _frame: Any) -> None:
            if self.ctx.is_main:
                log.info(
                    "signal received; stopping after the current step", extra={"signal": signum}
                )
                self.control.request_stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    # -- run ---------------------------------------------------------------------------------
    def run(self) -> int:
        code = 1
        try:
            self._install_signals()
            self._start_network()
            trainer = PPOTrainer(self.cfg, self.ctx)
            loop = TrainerLoop(
                self.cfg,
                trainer,
                paths=self.paths,
                control=self.control,
                io=self.io if self.ctx.is_main else None,
                buffer=self.buffer,
                publisher=self.publisher,
                metrics=self.metrics,
                on_ready=lambda: self._set_ready(True),
            )
            code = loop.run()
        except Exception:  # noqa: BLE001 - the exit status carries the failure
            log.error("trainer failed", extra={"traceback": traceback.format_exc()})
            code = 1
        finally:
            self._shutdown()
        return code

    def _shutdown(self) -> None:
        self._ready = False
        if self.metrics is not None:  # rank 0: its last series outlive the HTTP endpoint
            try:
                self.paths.metrics_textfile.parent.mkdir(parents=True, exist_ok=True)
                write_to_textfile(str(self.paths.metrics_textfile), self.metrics.registry)
            except OSError:
                log.exception("could not write the metrics textfile")
        if self.io is not None:
            try:
                if self.server is not None:
                    self.io.run(self.server.stop(grace=2.0), timeout=10)
                if self.buffer is not None:
                    self.io.run(self.buffer.close(), timeout=5)
                if self.publisher is not None:
                    self.io.run(self.publisher.close(), timeout=5)
            except Exception:  # noqa: BLE001 - best effort on the way out
                log.exception("shutdown of the network side failed")
            self.io.close()
        if self.http is not None:
            self.http.stop()


def run_rank(cfg: FlywheelConfig) -> int:
    """Entry of one rank (intra-op threads follow OMP_NUM_THREADS, which the rank
    launcher sets to 1 per rank unless the environment says otherwise)."""
    return TrainerService(cfg).run()
