"""Protobuf wire bytes of the buffer's bulk messages, written and split by hand.

Why: a group of 8 x 1,024 tokens is ~170 KB, and the generic path copies it again and
again. Building a `PutManyRequest` message copies every group into it and serializing the
nested message grows one buffer from small to megabytes (measured: ~250 us per group, more
than the group's own serialization, 14 us); on the buffer side, re-serializing the parsed
group to store it and `ByteSize()` to check it cost ~35 us more. Here the client serializes
each group once and writes the envelope around those bytes, and the buffer stores the very
bytes it received. Claim replies are likewise written around the stored bytes.

Only length-delimited envelopes are written (field numbers from `proto/flywheel/v1/`); the
splitter walks the envelope of a request that protobuf has already parsed, so it never
decides validity, only where each group's bytes are. The tests check every function
against the generated messages.
"""

from __future__ import annotations

from collections.abc import Sequence

# Field keys: (field number << 3) | wire type; 0 = varint, 2 = length-delimited.
_PUTMANY_PUTS = 0x0A  # PutManyRequest.puts = 1
_PUT_REQUEST_ID = 0x0A  # PutRequest.request_id = 1
_PUT_GROUP = 0x12  # PutRequest.group = 2
_CLAIM_GROUPS = 0x0A  # ClaimResponse.groups = 1
_CLAIM_VERSION = 0x10  # ClaimResponse.version = 2
_CLAIM_DROPPED = 0x18  # ClaimResponse.dropped_stale = 3


def varint(value: int) -> bytes:
    """Base-128 varint of a non-negative int."""
    if value < 0:
        raise ValueError(f"varint of a negative number ({value}) is not written here")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(key: int, payload: bytes | memoryview) -> list[bytes | memoryview]:
    return [bytes((key,)), varint(len(payload)), payload]


def _put_request_parts(request_id: str, group: bytes) -> list[bytes | memoryview]:
    parts: list[bytes | memoryview] = []
    if request_id:
        parts += _field(_PUT_REQUEST_ID, request_id.encode())
    parts += (bytes((_PUT_GROUP,)), varint(len(group)))
    return [*parts, group]


def encode_put_request(request_id: str, group: bytes) -> bytes:
    """Wire bytes of `PutRequest(request_id, group=<group, already serialized>)`."""
    return b"".join(_put_request_parts(request_id, group))


def encode_put_many(puts: Sequence[tuple[str, bytes]]) -> bytes:
    """Wire bytes of `PutManyRequest(puts=[PutRequest(request_id, group), ...])`, joined
    once: every group is copied a single time (megabytes of fresh memory per call are the
    expensive part of writing a request)."""
    parts: list[bytes | memoryview] = []
    for request_id, group in puts:
        inner = _put_request_parts(request_id, group)
        parts += (bytes((_PUTMANY_PUTS,)), varint(sum(len(x) for x in inner)), *inner)
    return b"".join(parts)


def encode_claim_response(
    version: int, dropped_stale: int, payloads: Sequence[bytes | memoryview]
) -> bytes:
    """Wire bytes of `ClaimResponse(groups=payloads, version, dropped_stale)`; both numbers
    are never negative here."""
    parts: list[bytes | memoryview] = []
    for p in payloads:
        parts += _field(_CLAIM_GROUPS, p)
    if version:
        parts += (bytes((_CLAIM_VERSION,)), varint(version))
    if dropped_stale:
        parts += (bytes((_CLAIM_DROPPED,)), varint(dropped_stale))
    return b"".join(parts)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: memoryview) -> list[tuple[int, memoryview]]:
    """(key, value) of every length-delimited field; other wire types are skipped."""
    out: list[tuple[int, memoryview]] = []
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _read_varint(data, pos)
        wire = key & 7
        if wire == 2:
            size, pos = _read_varint(data, pos)
            out.append((key, data[pos : pos + size]))
            pos += size
        elif wire == 0:
            _, pos = _read_varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:  # groups (3/4) are not used by proto3 messages
            raise ValueError(f"unexpected wire type {wire} at byte {pos}")
    return out


def put_group_bytes(put_request: memoryview) -> memoryview | None:
    """The serialized group inside one PutRequest's bytes, a view of them (no copy); None
    when the group field occurs more than once (protobuf merges the occurrences, so the
    stored bytes must come from the parsed message) or not at all."""
    groups = [v for k, v in _fields(put_request) if k == _PUT_GROUP]
    return groups[0] if len(groups) == 1 else None


def put_many_group_bytes(request: bytes) -> list[memoryview | None]:
    """`put_group_bytes` of every put of a PutManyRequest, in order."""
    view = memoryview(request)
    return [put_group_bytes(v) for k, v in _fields(view) if k == _PUTMANY_PUTS]
