"""The disk transport: a weights directory of safetensors shards and a JSON manifest.

A trainer that shares a volume with its replicas (and an SGLang server, which loads a
directory by path) publishes an update as files. The manifest is written last and
atomically, so a reader sees a complete update or none; the reader verifies it against the
manifest the update request carries before any tensor is used.

A replica loads only from its weights root (the trainer's `weight_dir`): the directory an
update names, and every file its manifest names, must resolve (symbolic links followed)
inside it. Anything else is refused with one message, `PATH_REFUSED`, whatever the reason
(outside the root, missing, not a directory, no manifest, a file name that climbs out of
the directory), so a caller learns nothing about which paths exist on the replica.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from services.common.weights.manifest import (
    WeightManifest,
    WeightsError,
    check_update_size,
    make_manifest,
    sorted_named_tensors,
    verify,
)

MANIFEST_FILE = "flywheel_weights.json"

PATH_REFUSED = (
    "path refused: not a complete weights directory inside this replica's weights root "
    "(trainer.weight_dir)"
)
"""The one answer to a disk update whose path cannot be loaded, whatever the reason."""


class WeightsPathRefused(WeightsError):
    """A disk update's path is outside the weights root or not a weights directory there;
    the message is always `PATH_REFUSED`, and `reason` (for the replica's own log) says
    which."""

    def __init__(self, reason: str) -> None:
        super().__init__(PATH_REFUSED)
        self.reason = reason


def weights_dir_in_root(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """The real path of the weights directory `path` (a relative one is taken from the
    working directory, as the trainer that sent it wrote it), after checking that it and
    every file its manifest names resolve inside `root`; raises `WeightsPathRefused`
    otherwise. Nothing outside `root` is opened: only its path is resolved."""
    real_root = Path(root).resolve()
    try:
        target = Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a loop of links, a NUL byte
        raise WeightsPathRefused(f"cannot resolve: {exc}") from None
    if not target.is_relative_to(real_root):
        raise WeightsPathRefused(f"{target} is outside {real_root}")
    try:
        if not target.is_dir():
            raise WeightsPathRefused(f"{target} is not a directory")
        if not (target / MANIFEST_FILE).resolve().is_relative_to(target):
            raise WeightsPathRefused(f"{target}'s manifest links out of it")
        manifest = read_manifest(target)
        for name in manifest.files:
            _check_file_name(name)
        named = [target / n for n in manifest.files] or sorted(target.glob("*.safetensors"))
        for f in named:
            if not (f.resolve().is_relative_to(target) and f.is_file()):
                raise WeightsPathRefused(f"{f}, named in {target}'s manifest, is not in it")
    except WeightsPathRefused:
        raise
    except (WeightsError, OSError, ValueError, TypeError, RuntimeError) as exc:
        raise WeightsPathRefused(f"{target}: {exc}") from None
    return target


def _check_file_name(name: str) -> None:
    """A file a manifest names is a plain name in the manifest's directory."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
        raise WeightsError(f"the manifest names {str(name)[:64]!r}: not a file of its directory")


def save_weights(
    directory: str | os.PathLike[str],
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    version: int,
    *,
    max_shard_bytes: int | None = None,
    manifest: WeightManifest | None = None,
) -> WeightManifest:
    """Write safetensors shard(s) and the manifest into `directory`; returns the manifest.

    The manifest is written last and atomically (rename), so a reader that finds it knows
    the shards are complete; a reader racing a writer sees either no manifest or a checksum
    mismatch, never a silently torn update. Files from a previous save are replaced.
    `manifest`: `make_manifest(named_tensors, version)` when the caller has computed it
    already (the checksum reads every byte: ~1 s for SmolLM2's 538 MB); a manifest of
    other tensors is caught by the reader's verification.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    items = sorted_named_tensors(named_tensors)
    if manifest is None:
        manifest = make_manifest(items, version)
    elif manifest.version != version or manifest.num_tensors != len(items):
        raise WeightsError(
            f"manifest of version {manifest.version} with {manifest.num_tensors} tensors "
            f"given for version {version} with {len(items)}"
        )
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    stale_manifest = directory / MANIFEST_FILE
    stale_manifest.unlink(missing_ok=True)
    for old in directory.glob("*.safetensors"):
        if old.name not in names:
            old.unlink()
    for fname, shard in zip(names, shards, strict=True):
        tmp = directory / f".{fname}.tmp"
        save_file(
            {n: t.detach().cpu().contiguous() for n, t in shard},
            str(tmp),
            # "format": "pt" is what transformers' loader requires of a safetensors file
            # that carries metadata at all; without it from_pretrained refuses the shard.
            metadata={"format": "pt", "flywheel_version": str(manifest.version)},
        )
        os.replace(tmp, directory / fname)
    manifest = WeightManifest(**{**manifest.__dict__, "files": tuple(names)})
    fd, tmp_name = tempfile.mkstemp(prefix=".manifest-", dir=directory)
    with os.fdopen(fd, "w") as fh:
        fh.write(manifest.to_json())
    os.replace(tmp_name, directory / MANIFEST_FILE)
    return manifest


def read_manifest(directory: str | os.PathLike[str]) -> WeightManifest:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise WeightsError(f"{path} is missing: not a complete Flywheel weights directory")
    return WeightManifest.from_json(path.read_text())


def weights_files(
    directory: str | os.PathLike[str], expected: WeightManifest | None = None
) -> tuple[WeightManifest, list[Path]]:
    """The manifest of a weights directory and the safetensors files it names, before any
    is opened: raises `WeightsError` when the directory, its manifest or a file is missing,
    or the manifest is not the one `expected` (the manifest carried by the update request)
    names, so a trainer that says "version 7" cannot be answered with whatever version
    happens to be on the volume."""
    directory = Path(directory)
    if not directory.is_dir():
        raise WeightsError(f"weights directory {directory} does not exist")
    manifest = read_manifest(directory)
    if expected is not None:
        if expected.checksum and expected.checksum != manifest.checksum:
            raise WeightsError(
                f"{directory} holds checksum {manifest.checksum[:16]}..., "
                f"the request expects {expected.checksum[:16]}..."
            )
        if expected.version != manifest.version:
            raise WeightsError(
                f"{directory} holds version {manifest.version}, the request expects "
                f"{expected.version}"
            )
    for name in manifest.files:
        _check_file_name(name)
    files = [directory / f for f in manifest.files] or sorted(directory.glob("*.safetensors"))
    for f in files:
        if not f.is_file():
            raise WeightsError(f"{f} named in the manifest is missing")
    return manifest, files


def load_weights(
    directory: str | os.PathLike[str],
    *,
    expected: WeightManifest | None = None,
    device: str | torch.device = "cpu",
) -> tuple[dict[str, torch.Tensor], WeightManifest]:
    """Read and verify a weights directory; raises `WeightsError` naming what is wrong.

    `expected` (the manifest carried by the update request) must agree with the
    directory's own manifest on version and checksum, so a trainer that says "version 7"
    cannot be answered with whatever version happens to be on the volume.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    manifest, files = weights_files(directory, expected)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f), device=str(device))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise WeightsError(f"{f} is unreadable (corrupt or truncated): {exc}") from exc
        dup = tensors.keys() & part.keys()
        if dup:
            raise WeightsError(f"{f} repeats tensors {sorted(dup)[:3]}")
        tensors.update(part)
    verify(tensors, manifest)
    return tensors, manifest


def check_weights_dir(directory: str | os.PathLike[str], max_bytes: int) -> WeightManifest:
    """The manifest of a weights directory, after checking that it and the files it names
    are within `max_bytes` (before any file is read into memory)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise WeightsError(f"weights directory {directory} does not exist")
    manifest = read_manifest(directory)
    check_update_size(manifest, None, max_bytes)
    for name in manifest.files:
        _check_file_name(name)
    files = [directory / f for f in manifest.files] or sorted(directory.glob("*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files if f.is_file())
    # safetensors adds a JSON header per file: allow it, not a second model.
    if on_disk > max_bytes + (1 << 20) * max(1, len(files)):
        raise WeightsError(
            f"{directory} holds {on_disk} bytes of weights, above "
            f"rollout.max_weight_bytes={max_bytes}"
        )
    return manifest
