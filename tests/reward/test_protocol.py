"""Worker wire protocol (`services/reward/protocol.py`): frames over real pipes."""

from __future__ import annotations

import asyncio
import os

import pytest

from services.reward import protocol


def test_frame_round_trip_over_a_pipe() -> None:
    r, w = os.pipe()
    try:
        msg = {"op": "score", "items": [{"completion": "é ∞ \x00 " * 1000, "ids": [1, 2]}]}
        protocol.write_frame_fd(w, msg)
        os.close(w)
        w = -1
        assert protocol.read_frame_fd(r) == msg
        assert protocol.read_frame_fd(r) is None  # end of stream
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_nan_is_refused_and_garbage_frames_raise() -> None:
    with pytest.raises(ValueError):
        protocol.encode_frame({"op": "result", "reward": float("nan")})
    with pytest.raises(protocol.ProtocolError, match="not JSON"):
        protocol.decode_body(b"\xff\xfe")
    with pytest.raises(protocol.ProtocolError, match="'op'"):
        protocol.decode_body(b"[1, 2]")


async def test_async_reader_and_oversized_length() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(protocol.encode_frame({"op": "ready", "pid": 1}))
    reader.feed_data(protocol.HEADER.pack(protocol.MAX_FRAME_BYTES + 1))
    reader.feed_eof()
    assert await protocol.read_frame(reader) == {"op": "ready", "pid": 1}
    with pytest.raises(protocol.ProtocolError, match="exceeds"):
        await protocol.read_frame(reader)
