"""The disk transport: safetensors directories written, read back, verified and bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.weights.disk import (
    MANIFEST_FILE,
    check_weights_dir,
    load_weights,
    save_weights,
)
from services.common.weights.manifest import WeightManifest, WeightsError, make_manifest
from tests.common.weights.samples import assert_bit_identical, sample_tensors


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


def test_check_weights_dir_bounds_the_directory_before_reading(tmp_path: Path) -> None:
    ts = sample_tensors()
    save_weights(tmp_path / "v1", ts, 1)
    assert check_weights_dir(tmp_path / "v1", 106).version == 1
    with pytest.raises(WeightsError, match="exceeds the limit"):
        check_weights_dir(tmp_path / "v1", 105)
