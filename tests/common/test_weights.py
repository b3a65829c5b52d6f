"""The weight-update format: checksum, safetensors directories, buckets, gRPC chunks."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
import torch

from services.common.weights import (
    MANIFEST_FILE,
    TensorSpec,
    WeightAssembler,
    WeightManifest,
    WeightsError,
    check_update_size,
    check_weights_dir,
    flatten_bucket,
    iter_weight_chunks,
    load_weights,
    make_buckets,
    make_manifest,
    save_weights,
    state_dict_checksum,
    tensor_specs,
    unflatten_bucket,
)


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "b.weight": torch.randn(3, 4, generator=g),
        "a.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.count": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d.empty": torch.empty(0, 2),
    }


def test_checksum_matches_the_documented_encoding() -> None:
    t = torch.tensor([1.0, -2.0], dtype=torch.float32)
    # name \0 dtype \0 shape \0 then little-endian float32 bytes of 1.0 and -2.0
    expected = hashlib.sha256(b"w\x00float32\x002\x00" + struct.pack("<ff", 1.0, -2.0)).hexdigest()
    assert state_dict_checksum({"w": t}) == expected


def test_checksum_ignores_order_and_layout_but_not_dtype_name_or_values() -> None:
    ts = sample_tensors()
    ref = state_dict_checksum(ts)
    assert state_dict_checksum(dict(reversed(list(ts.items())))) == ref
    transposed = dict(ts, **{"b.weight": ts["b.weight"].t().contiguous().t()})  # non-contiguous
    assert state_dict_checksum(transposed) == ref
    assert state_dict_checksum(dict(ts, **{"b.weight": ts["b.weight"].double()})) != ref
    assert state_dict_checksum({("z" + k): v for k, v in ts.items()}) != ref
    bumped = dict(ts, **{"b.weight": ts["b.weight"].clone()})
    bumped["b.weight"][0, 0] += 1e-6
    assert state_dict_checksum(bumped) != ref
    with pytest.raises(WeightsError, match="appears twice"):
        state_dict_checksum([("x", ts["a.bias"]), ("x", ts["a.bias"])])


def test_manifest_counts() -> None:
    m = make_manifest(sample_tensors(), 7)
    # bytes: 3*4*4=48, 5*2=10 (bf16), 6*8=48, 0 -> 106
    assert (m.version, m.num_tensors, m.total_bytes) == (7, 4, 106)
    assert WeightManifest.from_proto(m.to_proto()) == m
    assert WeightManifest.from_json(m.to_json()) == m


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(
            a[k].view(-1).view(torch.uint8), b[k].reshape(-1).contiguous().view(torch.uint8)
        ), k


def test_save_load_round_trip_bit_identical(tmp_path: Path) -> None:
    ts = sample_tensors()
    m = save_weights(tmp_path / "w", ts, 3)
    loaded, found = load_weights(tmp_path / "w", expected=m)
    assert found == m
    assert_bit_identical(ts, loaded)


def test_save_with_the_callers_manifest_writes_the_same_update(tmp_path: Path) -> None:
    # The publisher hashes the tensors once and hands the manifest over: same files, same
    # manifest as a save that hashes them itself; a manifest of another version is refused,
    # one of other tensors is caught by the reader's verification.
    ts = sample_tensors()
    own = save_weights(tmp_path / "own", ts, 3)
    given = save_weights(tmp_path / "given", ts, 3, manifest=make_manifest(ts, 3))
    assert given == own and given.files == own.files
    loaded, _ = load_weights(tmp_path / "given", expected=own)
    assert_bit_identical(ts, loaded)
    with pytest.raises(WeightsError, match="version 4"):
        save_weights(tmp_path / "bad", ts, 4, manifest=make_manifest(ts, 3))
    other = {k: v + 1 if v.is_floating_point() else v for k, v in ts.items()}
    save_weights(tmp_path / "other", other, 3, manifest=own)
    with pytest.raises(WeightsError):
        load_weights(tmp_path / "other")


def test_sharded_save_splits_files_and_loads_the_same(tmp_path: Path) -> None:
    ts = sample_tensors()
    # name order a(10 B), b(48), c(48), d(0) with 50-byte shards: [a], [b], [c, d]
    m = save_weights(tmp_path / "w", ts, 1, max_shard_bytes=50)
    assert len(m.files) == 3
    assert sorted(p.name for p in (tmp_path / "w").glob("*.safetensors")) == list(m.files)
    loaded, _ = load_weights(tmp_path / "w")
    assert_bit_identical(ts, loaded)


def test_corrupted_truncated_or_incomplete_directories_are_refused(tmp_path: Path) -> None:
    ts = sample_tensors()
    d = tmp_path / "w"
    save_weights(d, ts, 1)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF  # flip bits inside the last tensor's data
    f.write_bytes(bytes(raw))
    with pytest.raises(WeightsError, match="checksum mismatch"):
        load_weights(d)
    f.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(WeightsError, match="unreadable"):
        load_weights(d)
    (d / MANIFEST_FILE).unlink()
    with pytest.raises(WeightsError, match="missing"):
        load_weights(d)


def test_expected_manifest_must_agree(tmp_path: Path) -> None:
    ts = sample_tensors()
    m = save_weights(tmp_path / "w", ts, 4)
    with pytest.raises(WeightsError, match="expects 5"):
        load_weights(tmp_path / "w", expected=WeightManifest(5, m.checksum, 4, 106))
    with pytest.raises(WeightsError, match="checksum"):
        load_weights(tmp_path / "w", expected=WeightManifest(4, "0" * 64, 4, 106))


def test_make_buckets_groups_consecutive_specs() -> None:
    specs = [
        TensorSpec("a", "float32", (10,)),  # 40 B
        TensorSpec("b", "float32", (10,)),  # 40 B
        TensorSpec("c", "float32", (25,)),  # 100 B > bucket: alone
        TensorSpec("d", "int64", (1,)),  # 8 B
    ]
    buckets = make_buckets(specs, 96)
    assert [[s.name for s in b.specs] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [b.nbytes for b in buckets] == [80, 100, 8]
    with pytest.raises(WeightsError):
        make_buckets(specs, 0)


def test_flatten_unflatten_round_trip_keeps_every_dtype() -> None:
    ts = sample_tensors()
    out: dict[str, torch.Tensor] = {}
    for bucket in make_buckets(tensor_specs(ts), 50):
        flat = flatten_bucket(bucket, ts)
        assert flat.dtype == torch.uint8 and flat.numel() == bucket.nbytes
        out.update(unflatten_bucket(bucket, flat))
    assert_bit_identical(ts, out)


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
    # Issue 24: with total_bytes = 0 the assembler took 8 MiB under a 1 MiB cap.
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


def test_check_update_size_for_transports_that_send_specs_first() -> None:
    ts = sample_tensors()
    m = make_manifest(ts, 3)  # 106 bytes (see test_chunks_reassemble_bit_identical)
    specs = tensor_specs(ts)
    check_update_size(m, specs, 106)
    with pytest.raises(WeightsError, match="exceeds the limit"):
        check_update_size(m, specs, 105)
    with pytest.raises(WeightsError, match="tensor specs hold 48 bytes"):
        check_update_size(m, [s for s in specs if s.name == "b.weight"], 1000)
    with pytest.raises(WeightsError, match="announce its size"):
        check_update_size(WeightManifest(3, m.checksum, 4, 0), specs, 1000)


def test_check_weights_dir_bounds_the_directory_before_reading(tmp_path: Path) -> None:
    ts = sample_tensors()
    save_weights(tmp_path / "v1", ts, 1)
    assert check_weights_dir(tmp_path / "v1", 106).version == 1
    with pytest.raises(WeightsError, match="exceeds the limit"):
        check_weights_dir(tmp_path / "v1", 105)
