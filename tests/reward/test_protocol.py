"""Worker wire protocol (`services/reward/protocol.py`): frames over real pipes."""

from __future__ import annotations

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


def test_incremental_parser_handles_split_and_joined_frames() -> None:
    a = protocol.encode_frame({"op": "result", "id": 0, "reward": 1.0})
    b = protocol.encode_frame({"op": "result", "id": 1, "reward": 0.0})
    parser = protocol.FrameParser()
    data = a + b
    # Byte by byte: nothing until the first frame is whole, then exactly one frame.
    got = [f for byte in data[: len(a) - 1] for f in parser.feed(bytes([byte]))]
    assert got == []
    assert parser.feed(data[len(a) - 1 : len(a)]) == [{"op": "result", "id": 0, "reward": 1.0}]
    assert parser.feed(data[len(a) :]) == [{"op": "result", "id": 1, "reward": 0.0}]
    # Two frames in one read come out together.
    assert [f["id"] for f in protocol.FrameParser().feed(a + b)] == [0, 1]


def test_parser_refuses_oversized_length() -> None:
    with pytest.raises(protocol.ProtocolError, match="exceeds"):
        protocol.FrameParser().feed(protocol.HEADER.pack(protocol.MAX_FRAME_BYTES + 1))
