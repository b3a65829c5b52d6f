"""The gRPC transport: chunks reassembled bit for bit, bad or unbounded streams refused."""

from __future__ import annotations

import pytest
import torch

from services.common.weights.grpc_stream import WeightAssembler, iter_weight_chunks
from services.common.weights.manifest import WeightManifest, WeightsError, make_manifest
from tests.common.weights.samples import assert_bit_identical, sample_tensors


def test_chunks_reassemble_bit_identical() -> None:
    ts = sample_tensors()
    m = make_manifest(ts, 2)
    chunks = list(iter_weight_chunks(ts, m, chunk_bytes=16, request_id="r1"))
    # a: 10 B -> 1 chunk; b: 48 -> 3; c: 48 -> 3; d: 0 -> 1 empty chunk = 8
    assert len(chunks) == 8
    assert chunks[0].HasField("manifest") and not any(c.HasField("manifest") for c in chunks[1:])
    assert {c.request_id for c in chunks} == {"r1"}
    asm = WeightAssembler()
    for c in chunks:
        asm.add(c)
    out, got = asm.finish()
    assert got == m
    assert_bit_identical(ts, out)


def test_assembler_refuses_gaps_reorders_tampering_and_partial_streams() -> None:
    ts = sample_tensors()
    m = make_manifest(ts, 2)
    chunks = list(iter_weight_chunks(ts, m, chunk_bytes=16))

    asm = WeightAssembler()
    with pytest.raises(WeightsError, match="manifest"):
        asm.add(chunks[1])

    asm = WeightAssembler()
    asm.add(chunks[0])
    asm.add(chunks[1])
    with pytest.raises(WeightsError, match="offset"):
        asm.add(chunks[3])  # skips chunk 2 of tensor b

    asm = WeightAssembler()
    for c in chunks[:-2]:
        asm.add(c)
    with pytest.raises(WeightsError, match="partial update"):
        asm.finish()

    asm = WeightAssembler()
    for c in chunks:
        if c.name == "c.count" and c.offset == 0:
            c.data = bytes([c.data[0] ^ 1]) + c.data[1:]
        asm.add(c)
    with pytest.raises(WeightsError, match="checksum mismatch"):
        asm.finish()

    big = WeightAssembler(max_total_bytes=100)
    with pytest.raises(WeightsError, match="exceeds the limit"):
        big.add(chunks[0])  # manifest says 106 bytes


def _stream_of(n_bytes: int, total_bytes: int) -> list[object]:
    ts = {"w": torch.zeros(n_bytes, dtype=torch.uint8)}
    m = make_manifest(ts, 1)
    m = WeightManifest(m.version, m.checksum, m.num_tensors, total_bytes)
    return list(iter_weight_chunks(ts, m, chunk_bytes=1 << 20))


def test_a_stream_that_announces_no_size_is_refused_at_its_first_chunk() -> None:
    # A regression: with total_bytes = 0 the assembler took 8 MiB under a 1 MiB cap.
    chunks = _stream_of(8 << 20, total_bytes=0)
    asm = WeightAssembler(max_total_bytes=1 << 20)
    with pytest.raises(WeightsError, match="must announce its size"):
        asm.add(chunks[0])


def test_a_stream_is_capped_by_default_and_by_its_own_total() -> None:
    # No cap given: the 64 GiB default still applies (a manifest claiming 1 TiB is refused).
    with pytest.raises(WeightsError, match="exceeds the limit"):
        WeightAssembler().add(_stream_of(16, total_bytes=1 << 40)[0])
    # A manifest that under-announces: the shapes hold 2 MiB, the manifest says 1 MiB.
    asm = WeightAssembler(max_total_bytes=8 << 20)
    with pytest.raises(WeightsError, match="shapes hold more than"):
        asm.add(_stream_of(2 << 20, total_bytes=1 << 20)[0])
    # Over-announcing (total above the sum of the specs) is refused at the end.
    asm = WeightAssembler(max_total_bytes=8 << 20)
    for c in _stream_of(1 << 20, total_bytes=2 << 20):
        asm.add(c)
    with pytest.raises(WeightsError, match="tensor specs hold 1048576 bytes"):
        asm.finish()
