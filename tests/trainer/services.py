"""Real services for the trainer tests: a buffer on a real redis-server, on a loop thread.

The buffer runs in the test process (its own asyncio loop on a daemon thread, real gRPC on
loopback, real Redis) so a test can put groups, read stats and restart the trainer
process around it; the trainer itself runs as `python -m services.trainer`, as a user
starts it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from services.buffer.client import BufferClient
from services.buffer.service import BufferParts, BufferService, key_prefix
from services.common.config import FlywheelConfig
from services.core.types import TrajectoryGroup
from services.trainer.io_loop import IOLoop

ROOT = Path(__file__).resolve().parents[2]


class RunningBuffer:
    def __init__(self, cfg: FlywheelConfig, redis_url: str) -> None:
        self.io = IOLoop("test-buffer")
        parts = BufferParts.from_config(cfg)
        parts.buffer = cfg.buffer.model_copy(update={"redis_url": redis_url, "claim_poll_ms": 5})
        parts.prefix = key_prefix(cfg.buffer, cfg.experiment_name, cfg.trial_name)

        async def start() -> tuple[BufferService, BufferClient]:
            # gRPC aio objects belong to the loop they are created on.
            service = BufferService(parts)
            await service.start()
            return service, BufferClient(service.address)

        self.service, self.client = self.io.run(start(), timeout=30)

    @property
    def port(self) -> int:
        return self.service.port

    def put(self, groups: Sequence[TrajectoryGroup]) -> list[str]:
        return [self.io.run(self.client.put(g), timeout=30).result for g in groups]

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return self.io.run(coro, timeout)

    def close(self) -> None:
        self.io.run(self.client.close(), timeout=10)
        self.io.run(self.service.stop(grace=0.5), timeout=30)
        self.io.close()


@contextmanager
def running_buffer(cfg: FlywheelConfig, redis_url: str) -> Iterator[RunningBuffer]:
    buf = RunningBuffer(cfg, redis_url)
    try:
        yield buf
    finally:
        buf.close()


def write_config(cfg: FlywheelConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


def start_trainer(config_path: Path, *overrides: str, log_path: Path) -> subprocess.Popen:
    """`python -m services.trainer --config FILE` as its own process (stdout+stderr to a log)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    fh = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "services.trainer", "--config", str(config_path), *overrides],
        cwd=ROOT,
        env=env,
        stdout=fh,
        stderr=subprocess.STDOUT,
    )


def wait_serving(
    address: str, proc: subprocess.Popen, log_path: Path, timeout: float = 120.0
) -> None:
    """Block until the service at `address` reports SERVING; fail at once (with its log
    tail) if its process exits first."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"service exited with {proc.returncode} before serving:\n{tail}")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s")
            time.sleep(0.1)


@contextmanager
def running_replica(cfg: FlywheelConfig, root: Path) -> Iterator[str]:
    """`python -m services.rollout --eval-only` on `cfg` as its own process (the torch
    engine, no buffer or reward); yields its address once it serves."""
    path = write_config(cfg, root / "rollout.yaml")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    log_path = root / "rollout.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.rollout", "--config", str(path), "--eval-only"],
        cwd=ROOT,
        env=env,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
    )
    address = cfg.services.rollout.replica_address(0)
    try:
        wait_serving(address, proc, log_path)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
