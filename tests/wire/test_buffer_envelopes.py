"""Hand-written wire bytes (services/wire/buffer_envelopes.py) parse as the generated
messages, and the splitter finds exactly the bytes of each put's group."""

from __future__ import annotations

import pytest

from flywheel_proto.v1 import buffer_pb2
from services.common.codec import group_to_proto
from services.wire import buffer_envelopes
from tests.buffer.helpers import make_group


def group_bytes(gid: str) -> bytes:
    return group_to_proto(make_group(gid)).SerializeToString()


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 1 << 21, (1 << 63) - 1])
def test_varint_matches_protobuf(value: int) -> None:
    assert (
        buffer_pb2.ClaimResponse.FromString(b"\x10" + buffer_envelopes.varint(value)).version
        == value
    )
    if value:  # proto3 writes no field for 0
        msg = buffer_pb2.ClaimResponse(version=value)
        assert msg.SerializeToString() == b"\x10" + buffer_envelopes.varint(value)


def test_varint_refuses_negative_numbers() -> None:
    with pytest.raises(ValueError, match="negative"):
        buffer_envelopes.varint(-1)


@pytest.mark.parametrize("rid", ["", "r-1", "é" * 200])
def test_put_request_parses_as_the_proto(rid: str) -> None:
    g = group_bytes("a")
    got = buffer_pb2.PutRequest.FromString(buffer_envelopes.encode_put_request(rid, g))
    assert got.request_id == rid
    assert got.group.SerializeToString() == g
    assert (
        buffer_envelopes.put_group_bytes(memoryview(buffer_envelopes.encode_put_request(rid, g)))
        == g
    )


def test_put_many_parses_as_the_proto_and_splits_back() -> None:
    puts = [(f"r{i}", group_bytes(f"g{i}")) for i in range(3)]
    data = buffer_envelopes.encode_put_many(puts)
    got = buffer_pb2.PutManyRequest.FromString(data)
    assert [(p.request_id, p.group.SerializeToString()) for p in got.puts] == puts
    assert buffer_envelopes.put_many_group_bytes(data) == [g for _, g in puts]
    # The generated serializer's bytes split the same way.
    assert buffer_envelopes.put_many_group_bytes(got.SerializeToString()) == [g for _, g in puts]
    assert buffer_envelopes.encode_put_many([]) == b""


def test_splitter_skips_unknown_fields_of_every_wire_type() -> None:
    g = group_bytes("a")
    unknown = b"\x78\x05" + b"\x81\x01" + b"\x00" * 8 + b"\x8d\x01" + b"\x00" * 4  # 15, 16, 17
    put = unknown + buffer_envelopes.encode_put_request("r", g) + b"\x9a\x01\x02hi"  # 19: bytes
    assert buffer_pb2.PutRequest.FromString(put).group.SerializeToString() == g
    assert buffer_envelopes.put_group_bytes(memoryview(put)) == g


def test_a_group_field_given_twice_is_left_to_the_parser() -> None:
    """Protobuf merges repeated occurrences of a message field, so no single slice of the
    bytes is the group: the splitter says so instead of picking one."""
    first = group_to_proto(make_group("a"))
    second = buffer_pb2.PutRequest(group={"prompt_id": "p7"}).SerializeToString()
    data = buffer_pb2.PutRequest(group=first).SerializeToString() + second
    assert buffer_pb2.PutRequest.FromString(data).group.prompt_id == "p7"
    assert buffer_envelopes.put_group_bytes(memoryview(data)) is None
    assert buffer_envelopes.put_group_bytes(memoryview(b"\x0a\x01r")) is None  # no group at all


def test_claim_reply_bytes_parse_as_the_proto() -> None:
    payloads = [group_bytes(g) for g in ("a", "b")]
    for version, dropped in [(0, 0), (1, 0), (300, 2), ((1 << 40) + 5, 129)]:
        reply = buffer_envelopes.encode_claim_response(version, dropped, payloads)
        got = buffer_pb2.ClaimResponse.FromString(reply)
        assert (got.version, got.dropped_stale) == (version, dropped)
        assert [g.SerializeToString() for g in got.groups] == payloads
    assert buffer_envelopes.encode_claim_response(0, 0, []) == b""
