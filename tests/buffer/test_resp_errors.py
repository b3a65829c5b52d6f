"""Error replies read by the hand-written pipeline become the exceptions redis-py raises.

A restarted Redis answers `-LOADING ...` while it replays its AOF. redis-py raises
BusyLoadingError (a ConnectionError) for it, which the buffer answers as UNAVAILABLE and
clients retry; read as a plain ResponseError it became INTERNAL, and a fleet's puts failed
for the seconds of the replay (seen in the fleet simulator's Redis restart).
"""

from __future__ import annotations

import asyncio

import redis.exceptions as redis_errors

from services.buffer.resp import read_reply


async def _reply(raw: bytes) -> object:
    reader = asyncio.StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    return await read_reply(reader)


async def test_loading_is_an_outage_not_a_failed_command() -> None:
    err = await _reply(b"-LOADING Redis is loading the dataset in memory\r\n")
    assert isinstance(err, redis_errors.BusyLoadingError)
    assert isinstance(err, redis_errors.ConnectionError)  # the servicer's UNAVAILABLE branch


async def test_other_error_replies_keep_their_types() -> None:
    assert isinstance(await _reply(b"-NOSCRIPT No matching script\r\n"), redis_errors.NoScriptError)
    err = await _reply(b"-ERR wrong number of arguments\r\n")
    assert type(err) is redis_errors.ResponseError
