"""The hand-written RESP pipeline (services/buffer/resp.py) against a real redis-server,
checked reply for reply against what redis-py itself answers."""

from __future__ import annotations

import asyncio

import pytest
import redis
from redis import exceptions as redis_errors

from services.buffer.resp import pack, run_pipeline
from services.buffer.store import connect
from services.common.redis_server import RedisServer, free_port
from tests.waiting import until

pytestmark = pytest.mark.integration

NESTED = "return {1, {2, 'x', {}}, 'three', false}"


def _blocked(url: str) -> bool:
    """Whether a client is blocked in Redis (asked over a connection of its own)."""
    with redis.Redis.from_url(url) as other:
        return int(other.info("clients")["blocked_clients"]) >= 1


def test_pack_writes_resp_and_passes_large_payloads_through_uncopied() -> None:
    big = memoryview(b"p" * 5000)
    chunks = pack(["SET", b"k", big, 7])
    assert chunks[1] is big
    assert b"".join(bytes(c) for c in chunks) == (
        b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$5000\r\n" + b"p" * 5000 + b"\r\n$1\r\n7\r\n"
    )
    with pytest.raises(TypeError, match="float"):
        pack(["SET", "k", 1.5])  # type: ignore[list-item]


async def test_replies_match_redis_py_for_every_type(redis_server: RedisServer) -> None:
    client = connect(redis_server.url)
    payload = bytes(range(256)) * 1000  # every byte value, larger than one inline chunk
    try:
        commands = [
            ("SET", "blob", memoryview(payload)),
            ("GET", "blob"),
            ("GET", "missing"),
            ("INCRBY", "n", 41),
            ("INCR", "n"),
            ("EVAL", NESTED, 0),
            ("PING",),
            ("INCR", "blob"),  # an error reply, in its place
            ("SET", "after", "still runs"),
        ]
        got = await run_pipeline(client, commands)
        assert got[:7] == [
            b"OK",
            payload,
            None,
            41,
            42,
            [1, [2, b"x", []], b"three", None],
            b"PONG",
        ]
        assert isinstance(got[7], redis_errors.ResponseError) and "integer" in str(got[7])
        assert got[8] == b"OK" and await client.get("after") == b"still runs"
        expected = await client.eval(NESTED, 0)
        assert expected == got[5]
    finally:
        await client.aclose()


async def test_a_missing_script_comes_back_as_noscript(redis_server: RedisServer) -> None:
    client = connect(redis_server.url)
    try:
        sha = await client.script_load("return ARGV[1]")
        got = await run_pipeline(client, [("EVALSHA", sha, 0, "a"), ("EVALSHA", "0" * 40, 0, "b")])
        assert got[0] == b"a" and isinstance(got[1], redis_errors.NoScriptError)
    finally:
        await client.aclose()


async def test_a_timed_out_pipeline_does_not_leave_its_reply_for_the_next(
    redis_server: RedisServer,
) -> None:
    """BLPOP outlives the socket timeout: the late reply must never be read as the answer
    to a later command, so the connection is dropped, not returned to the pool."""
    client = connect(redis_server.url)
    client.connection_pool.connection_kwargs["socket_timeout"] = 0.2
    try:
        with pytest.raises(redis_errors.TimeoutError):
            await run_pipeline(client, [("BLPOP", "never", 1)])
        # New connections get a generous timeout (0.2 s can pass on a loaded machine before
        # Redis answers a plain RPUSH); a connection wrongly kept in the pool keeps 0.2 s.
        client.connection_pool.connection_kwargs["socket_timeout"] = 60
        await client.rpush("never", "late")  # BLPOP would now answer with it
        assert await run_pipeline(client, [("GET", "x"), ("LLEN", "never")]) == [None, 1]
    finally:
        await client.aclose()


async def test_a_cancelled_pipeline_drops_its_connection(redis_server: RedisServer) -> None:
    client = connect(redis_server.url)
    try:
        task = asyncio.create_task(run_pipeline(client, [("BLPOP", "q", 2)]))
        await until(lambda: _blocked(redis_server.url), "the BLPOP to block in Redis", 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.rpush("q", "v")
        assert await run_pipeline(client, [("LRANGE", "q", 0, -1)]) == [[b"v"]]
    finally:
        await client.aclose()


async def test_an_unreachable_redis_raises_redis_py_connection_error() -> None:
    client = connect(f"redis://127.0.0.1:{free_port()}/0")
    try:
        with pytest.raises(redis_errors.ConnectionError):
            await run_pipeline(client, [("PING",)])
    finally:
        await client.aclose()


async def test_a_server_killed_mid_reply_raises_connection_error(tmp_path) -> None:  # noqa: ANN001
    server = RedisServer(dir=tmp_path / "redis")
    server.start()
    client = connect(server.url)
    try:
        task = asyncio.create_task(run_pipeline(client, [("BLPOP", "q", 5)]))
        await until(lambda: _blocked(server.url), "the BLPOP to block in Redis", 10)
        server.cleanup()  # the server goes away while the reply is awaited
        with pytest.raises(redis_errors.ConnectionError):
            await task
    finally:
        await client.aclose()
