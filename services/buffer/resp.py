"""Pipelined Redis commands written and read by hand, on a connection from redis-py's pool.

Why: a PutMany sends megabytes to Redis as one pipeline of admission scripts, and
redis-py's asyncio pipeline spends more CPU on its own machinery than on the bytes: a 2-core
measurement of 8 groups of 8 x 1,024 tokens per pipeline gave 175-195 us per group through
`pipeline().execute()` and 103-123 us with the RESP below (`benchmarks/buffer.py` puts are
bound by this process's CPU, so it shows in throughput).

What is kept from redis-py: the connection pool and everything a connection does on
connect (TCP or TLS, AUTH, SELECT, client name), and its exception classes, so callers and
the service's UNAVAILABLE mapping see the same errors as from redis-py itself. What is
replaced: packing arguments and parsing replies. A pipeline that fails part-way (timeout,
cancellation, broken connection) leaves unknown bytes in flight, so its connection is
disconnected before it goes back to the pool; a reply of type error (`-NOSCRIPT ...`)
does not break the connection and comes back in its place as an exception instance, as
redis-py's `execute(raise_on_error=False)` does.

It reads the connection's stream directly (redis-py's `_reader`/`_writer`, present since
the asyncio client exists); `run_pipeline` checks that they are there and says so if a
future redis-py renames them.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

Arg = bytes | memoryview | str | int
_INLINE_MAX = 4096  # larger arguments are written as their own chunk, never copied


def _pool_wants_a_command_name() -> bool:
    """redis-py before 5.3 requires `get_connection(command_name)`; later ones deprecate it."""
    param = inspect.signature(aioredis.ConnectionPool.get_connection).parameters.get("command_name")
    return param is not None and param.default is inspect.Parameter.empty


_GET_CONNECTION_ARGS = ("EVALSHA",) if _pool_wants_a_command_name() else ()


def pack(args: Sequence[Arg]) -> list[bytes | memoryview]:
    """One command as RESP chunks: small pieces joined, large payloads passed through."""
    chunks: list[bytes | memoryview] = []
    head: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        elif not isinstance(arg, bytes | memoryview):
            raise TypeError(f"cannot send {type(arg).__name__} to Redis")
        head.append(b"$%d\r\n" % len(arg))
        if len(arg) > _INLINE_MAX:
            chunks.append(b"".join(head))
            chunks.append(arg)
            head = [b"\r\n"]
        else:
            head += (arg, b"\r\n")
    chunks.append(b"".join(head))
    return chunks


def _error(message: str) -> redis_errors.RedisError:
    """The exception redis-py would raise for this error reply. `LOADING` (a restarted Redis
    replaying its AOF) is a ConnectionError there, so callers treat it as an outage and
    retry, not as a failed command."""
    if message.startswith("NOSCRIPT"):
        return redis_errors.NoScriptError(message)
    if message.startswith("LOADING"):
        return redis_errors.BusyLoadingError(message)
    return redis_errors.ResponseError(message)


async def read_reply(reader: asyncio.StreamReader) -> Any:
    """One RESP2 reply (RESP3's null too): bulk strings as bytes, arrays as lists, errors as
    exception instances."""
    line = await reader.readuntil(b"\r\n")
    kind, rest = line[:1], line[1:-2]
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else (await reader.readexactly(n + 2))[:-2]
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [await read_reply(reader) for _ in range(n)]
    if kind == b":":
        return int(rest)
    if kind == b"+":
        return rest
    if kind == b"-":
        return _error(rest.decode(errors="replace"))
    if kind == b"_":
        return None
    raise redis_errors.InvalidResponse(f"unexpected Redis reply {line[:40]!r}")


async def run_pipeline(client: aioredis.Redis, commands: Sequence[Sequence[Arg]]) -> list[Any]:
    """Send every command, then read every reply, on one pooled connection."""
    pool = client.connection_pool
    conn = await pool.get_connection(*_GET_CONNECTION_ARGS)
    done = False
    try:
        reader, writer = getattr(conn, "_reader", None), getattr(conn, "_writer", None)
        if not isinstance(reader, asyncio.StreamReader) or writer is None:
            raise RuntimeError(
                f"{type(conn).__name__} has no asyncio streams (_reader/_writer): this "
                "redis-py is not supported by services/buffer/resp.py"
            )
        try:
            async with asyncio.timeout(getattr(conn, "socket_timeout", None)):
                for command in commands:
                    for chunk in pack(command):  # not writelines: it joins (copies) them
                        writer.write(chunk)
                await writer.drain()
                replies = [await read_reply(reader) for _ in commands]
        except TimeoutError:
            raise redis_errors.TimeoutError("Timeout reading from Redis") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as err:
            raise redis_errors.ConnectionError(f"Redis connection lost: {err!r}") from err
        done = True
        return replies
    finally:
        if not done:  # replies may still be in flight: this connection's stream is unusable
            await conn.disconnect(nowait=True)
        await pool.release(conn)
