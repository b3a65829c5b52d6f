"""The wire between the service and its worker processes: length-prefixed JSON frames.

Why not `multiprocessing`: its pipes pickle, and the project allows no pickle across a
process boundary (a worker runs user code; unpickling what it sends back would hand it
the service). JSON over the worker's own pipe is enough: every field is a string, a
number or a list of token ids.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON.

Service → worker:
    {"op": "init", "memory_bytes": int, "cpu_seconds": float, "sys_path": [str],
     "preload": [path], "warmup": [path]}           # first frame, once
    {"op": "score", "items": [{"id": int, "fn": path, "prompt": str, "completion": str,
     "prompt_ids": [int], "completion_ids": [int], "answer": str, "kwargs": {...}}]}
Worker → service:
    {"op": "ready", "pid": int}
    {"op": "result", "id": int, "status": "OK"|"ERROR"|"INVALID_INPUT", "reward": float,
     "message": str, "t0": float, "t1": float, "restart": bool, "reason": str}
                                                      # one per item, in order
`t0`/`t1` are `time.monotonic()` in the worker (CLOCK_MONOTONIC is system-wide on Linux),
so the service knows when the next item of a chunk started and can time its deadline.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

HEADER = struct.Struct(">I")
# A frame holds at most one chunk of items; the service caps completions far below this.
MAX_FRAME_BYTES = 512 << 20


class ProtocolError(RuntimeError):
    """A frame that is not what the protocol says (oversized, not JSON, not an object)."""


def encode_frame(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from exc
    if not isinstance(msg, dict) or "op" not in msg:
        raise ProtocolError("frame is not a JSON object with an 'op'")
    return msg


def _check_length(length: int) -> None:
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")


# --- blocking side (the worker) ---------------------------------------------------------


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks: list[bytes] = []
    remaining = n
    while remaining:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame_fd(fd: int) -> dict[str, Any] | None:
    """Next frame from a file descriptor, or None at end of stream."""
    head = _read_exact(fd, HEADER.size)
    if head is None:
        return None
    (length,) = HEADER.unpack(head)
    _check_length(length)
    body = _read_exact(fd, length)
    if body is None:
        return None
    return decode_body(body)


def write_frame_fd(fd: int, msg: dict[str, Any]) -> None:
    data = memoryview(encode_frame(msg))
    while data:
        written = os.write(fd, data)
        data = data[written:]


# --- asyncio side (the service) ---------------------------------------------------------


class FrameParser:
    """Incremental decoder: feed it bytes as they arrive, take whole frames out.

    The service reads worker pipes through this (from an asyncio protocol callback), so
    that several results that arrived together cost one wake-up, not one each.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Append `data`; return the frames now complete (raises ProtocolError)."""
        self._buf += data
        frames: list[dict[str, Any]] = []
        buf, pos = self._buf, 0
        while len(buf) - pos >= HEADER.size:
            (length,) = HEADER.unpack_from(buf, pos)
            _check_length(length)
            end = pos + HEADER.size + length
            if len(buf) < end:
                break
            frames.append(decode_body(bytes(buf[pos + HEADER.size : end])))
            pos = end
        if pos:
            del buf[:pos]  # compact once per feed, not once per frame
        return frames
