"""The assembled buffer (services/buffer/service.py) against a real redis-server that
requires a password: the forms of the password the docs name reach Redis decoded, and a
Redis that refuses the buffer is visible from the first attempt (log, metric, health)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from services.buffer.client import BufferClient
from services.buffer.service import BufferParts, BufferService
from services.common.config import BufferConfig, RolloutConfig
from services.common.redis_server import RedisServer
from services.launcher.assets import RunSecrets, resolved_config_data
from tests.run_configs import tiny_run_config

from .test_servicer import health

pytestmark = pytest.mark.integration

PASSWORD = "the s3cret"  # a space: written %20 in a URL (RFC 3986 percent-encoding)
PREFIX = "{test:auth:trial}:buf"


@pytest.fixture
def locked_redis(tmp_path: Path):  # noqa: ANN201
    with RedisServer(password=PASSWORD, dir=tmp_path / "redis") as server:
        yield server


def _parts(redis_url: str, tmp_path: Path) -> BufferParts:
    return BufferParts(
        buffer=BufferConfig(redis_url=redis_url, health_check_interval_s=0.05),
        rollout=RolloutConfig(consumer_batch_size=2),
        prefix=PREFIX,
        export_dir=str(tmp_path / "exports"),
    )


async def _serving(parts: BufferParts) -> tuple[bool, BufferService]:
    service = BufferService(parts)
    await service.start()
    return service.redis_ok, service


async def test_an_encoded_password_in_the_url_reaches_redis_decoded(
    locked_redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLYWHEEL_REDIS_PASSWORD", raising=False)
    url = f"redis://:the%20s3cret@127.0.0.1:{locked_redis.port}/0"
    ok, service = await _serving(_parts(url, tmp_path))
    try:
        assert ok and await health(service.address) == health_pb2.HealthCheckResponse.SERVING
        async with BufferClient(service.address) as client:
            assert await client.set_version(1) == 1
    finally:
        await service.stop(grace=0.5)


async def test_the_local_launcher_hands_the_buffer_the_decoded_password(
    locked_redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The launcher takes the password out of buffer.redis_url (the config file holds none)
    # and gives it to the buffer alone as FLYWHEEL_REDIS_PASSWORD. It used to pass
    # "the%20s3cret" on: Redis refused it and the buffer never became ready.
    from services.common.config.loader import validate

    raw = tiny_run_config(tmp_path / "runs", experiment="auth", steps=10)
    raw["buffer"] = {"redis_url": f"redis://:the%20s3cret@127.0.0.1:{locked_redis.port}/0"}
    cfg = validate(raw)
    env = RunSecrets.of(cfg).environment("buffer")
    assert env["FLYWHEEL_REDIS_PASSWORD"] == PASSWORD
    url = resolved_config_data(cfg)["buffer"]["redis_url"]
    assert url == f"redis://127.0.0.1:{locked_redis.port}/0"
    monkeypatch.setenv("FLYWHEEL_REDIS_PASSWORD", env["FLYWHEEL_REDIS_PASSWORD"])
    ok, service = await _serving(_parts(url, tmp_path))
    try:
        assert ok and service.metrics.redis_up._value.get() == 1
    finally:
        await service.stop(grace=0.5)


@pytest.mark.parametrize("given", ["wr0ng s3cret", None])
async def test_a_redis_that_refuses_the_buffer_from_the_start_is_logged_and_shown(
    locked_redis: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    given: str | None,
) -> None:
    # Redis answers WRONGPASS to a wrong password and NOAUTH to none (redis.io, AUTH);
    # redis-py raises AuthenticationError for both. Only a change from OK to failing was
    # logged: a buffer refused from its first attempt said nothing.
    monkeypatch.delenv("FLYWHEEL_REDIS_PASSWORD", raising=False)
    if given is not None:
        monkeypatch.setenv("FLYWHEEL_REDIS_PASSWORD", given)
    caplog.set_level(logging.INFO, logger="services.buffer.service")
    ok, service = await _serving(_parts(f"redis://127.0.0.1:{locked_redis.port}/0", tmp_path))
    try:
        assert not ok
        assert await health(service.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert service.metrics.redis_auth_failed._value.get() == 1
        assert service.metrics.redis_up._value.get() == 0
        refused = [r for r in caplog.records if "refuses the buffer's credentials" in r.message]
        assert len(refused) == 1 and refused[0].levelno == logging.ERROR
        # Later checks fail the same way: logged once, not once per check.
        checks = service.metrics.redis_errors._value.get()
        while service.metrics.redis_errors._value.get() < checks + 3:
            await service._check_redis()
        assert sum("refuses the buffer's credentials" in r.message for r in caplog.records) == 1
        for record in caplog.records:  # neither Redis's password nor the one given
            assert "s3cret" not in record.getMessage() + repr(record.__dict__)
    finally:
        await service.stop(grace=0.5)
