"""Run `python -m services.buffer --config FILE` as a real child process, killable with SIGKILL."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]


class BufferProcess:
    """The buffer service in its own process, on a fixed port so a restart keeps the address."""

    def __init__(
        self,
        workdir: Path,
        redis_url: str,
        buffer: dict[str, Any] | None = None,
        rollout: dict[str, Any] | None = None,
    ) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.config = workdir / "buffer.yaml"
        cfg = {
            "experiment_name": "killtest",
            "trial_name": "t0",
            "cluster": {"fileroot": str(workdir / "fileroot")},
            "actor": {"kl_ctl": 0.0},
            "rollout": {
                "consumer_batch_size": 2,
                "max_head_offpolicyness": 1000,
                **(rollout or {}),
            },
            "buffer": {"redis_url": redis_url, "claim_poll_ms": 5, **(buffer or {})},
            "services": {"buffer": {"port": self.port, "metrics_port": 0}, "auth_token": None},
        }
        self.config.write_text(yaml.safe_dump(cfg))
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / f"buffer-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.buffer", "--config", str(self.config)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "wb"),  # noqa: SIM115 - lives as long as the child
        )

    async def wait_serving(self) -> None:
        """Until grpc.health says SERVING; fails at once if the child died."""
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"buffer exited {self.proc.returncode}: {self.log.read_text()[-3000:]}"
                )
            if await self.health() == health_pb2.HealthCheckResponse.SERVING:
                return
            await asyncio.sleep(0.05)

    async def health(self) -> int | None:
        try:
            async with grpc.aio.insecure_channel(self.address) as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="flywheel.v1.BufferService"), timeout=1
                )
                return resp.status
        except grpc.aio.AioRpcError:
            return None

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
