"""The disk transport: safetensors directories written, read back, verified and bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.weights.disk import (
    MANIFEST_FILE,
    PATH_REFUSED,
    WeightsPathRefused,
    check_weights_dir,
    load_weights,
    save_weights,
    weights_dir_in_root,
)
from services.common.weights.manifest import WeightManifest, WeightsError, make_manifest
from tests.common.weights.samples import assert_bit_identical, sample_tensors


def test_save_load_round_trip_bit_identical(tmp_path: Path) -> None:
    ts = sample_tensors()
    m = save_weights(tmp_path / "w", ts, 3)
    loaded, found = load_weights(tmp_path / "w", expected=m)
    assert found == m
    assert_bit_identical(ts, loaded)


def test_published_shards_load_with_transformers_own_reader(tmp_path: Path) -> None:
    # The reference is transformers' `load_state_dict`, the reader `from_pretrained` uses:
    # it refuses a safetensors file whose metadata lacks a known "format".
    from transformers.modeling_utils import load_state_dict

    ts = sample_tensors()
    save_weights(tmp_path / "w", ts, 3)
    loaded = load_state_dict(str(tmp_path / "w" / "model.safetensors"))
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


HOSTNAME_FROM_A_DEPTH_OF_4 = "/".join([".."] * 4 + ["etc", "hostname"])
"""The manifest entry of the report: four levels up, then /etc/hostname."""


def _rename_files(directory: Path, files: list) -> None:  # noqa: ANN001
    import json

    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    manifest["files"] = files
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_weights_dirs_resolve_inside_the_root_or_are_refused_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    save_weights(root / "v1", sample_tensors(), 1)
    save_weights(outside / "v1", sample_tensors(), 1)
    assert weights_dir_in_root(root, root / "v1") == (root / "v1").resolve()
    # A relative path is the trainer's, from the working directory both processes share.
    monkeypatch.chdir(tmp_path)
    assert weights_dir_in_root("root", "root/v1") == (root / "v1").resolve()
    (root / "alias").symlink_to(root / "v1")  # a link that stays inside is followed
    assert weights_dir_in_root(root, root / "alias") == (root / "v1").resolve()
    (root / "out").symlink_to(outside / "v1")
    climbing = "/".join(["root", "v1", "..", "..", "outside", "v1"])  # up twice, into outside
    for bad in [climbing, str(outside / "v1"), "root/out", "root/missing", "/etc", "a\x00b"]:
        with pytest.raises(WeightsPathRefused) as err:
            weights_dir_in_root(root, bad)
        assert str(err.value) == PATH_REFUSED and err.value.reason


@pytest.mark.parametrize(
    "files",
    [[HOSTNAME_FROM_A_DEPTH_OF_4], ["/etc/hostname"], [".."], ["sub/model.safetensors"], [7]],
)
def test_a_manifest_naming_files_outside_its_directory_is_refused(
    tmp_path: Path, files: list
) -> None:
    # The manifest is data the replica reads: its file names are plain names of files in
    # its own directory, never paths (the disk transport's reader never leaves it).
    save_weights(tmp_path / "v1", sample_tensors(), 1)
    _rename_files(tmp_path / "v1", files)
    with pytest.raises(WeightsPathRefused) as err:
        weights_dir_in_root(tmp_path, tmp_path / "v1")
    assert str(err.value) == PATH_REFUSED
    with pytest.raises(WeightsError):
        load_weights(tmp_path / "v1")
    with pytest.raises(WeightsError):
        check_weights_dir(tmp_path / "v1", 1 << 30)


def test_a_manifest_or_shard_linked_out_of_its_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    save_weights(root / "v1", sample_tensors(), 1)
    save_weights(tmp_path / "elsewhere", sample_tensors(), 1)
    shard = root / "v1" / "model.safetensors"
    shard.unlink()
    shard.symlink_to(tmp_path / "elsewhere" / "model.safetensors")
    with pytest.raises(WeightsPathRefused):
        weights_dir_in_root(root, root / "v1")
    save_weights(root / "v2", sample_tensors(), 2)
    (root / "v2" / MANIFEST_FILE).unlink()
    (root / "v2" / MANIFEST_FILE).symlink_to(tmp_path / "elsewhere" / MANIFEST_FILE)
    with pytest.raises(WeightsPathRefused):
        weights_dir_in_root(root, root / "v2")
