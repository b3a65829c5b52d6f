"""What every weight transport agrees on: tensor specs, the checksum and the manifest.

The trainer and a rollout replica may exchange weights over disk, torch.distributed or gRPC;
whichever they use, the receiver checks the same manifest (target version, SHA-256 over the
tensors in name order, counts) and the same size bound before it allocates. This module holds
that shared contract so each transport module depends on it and on nothing else.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

FORMAT_VERSION = 1

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("services.common.weights assumes a little-endian host")

_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class WeightsError(ValueError):
    """A weight update that cannot be applied (corrupt, partial, mismatched); says why."""


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype ("float32", "bfloat16", ...)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise WeightsError(
            f"dtype {dtype} is not supported; use one of {sorted(_DTYPES)}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """Torch dtype of a wire name; unknown names list the valid ones."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise WeightsError(
            f"dtype {name!r} is not supported; use one of {sorted(_DTYPES)}"
        ) from None


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor: enough to allocate a receive buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=torch_dtype(self.dtype)).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape))

    def to_proto(self) -> Any:
        from flywheel_proto.v1 import rollout_pb2

        return rollout_pb2.TensorSpec(name=self.name, dtype=self.dtype, shape=list(self.shape))

    @classmethod
    def from_proto(cls, msg: Any) -> TensorSpec:
        torch_dtype(msg.dtype)  # validate early, naming the bad dtype
        if any(d < 0 for d in msg.shape):
            raise WeightsError(
                f"tensor {msg.name!r}: negative dimension in shape {list(msg.shape)}"
            )
        return cls(msg.name, msg.dtype, tuple(int(d) for d in msg.shape))


@dataclass(frozen=True)
class WeightManifest:
    """What a receiver checks an update against: target version, checksum, counts."""

    version: int
    checksum: str
    num_tensors: int
    total_bytes: int
    format_version: int = FORMAT_VERSION
    files: tuple[str, ...] = field(default=(), compare=False)

    def to_proto(self) -> Any:
        from flywheel_proto.v1 import common_pb2

        return common_pb2.WeightManifest(
            version=self.version,
            checksum=self.checksum,
            num_tensors=self.num_tensors,
            total_bytes=self.total_bytes,
        )

    @classmethod
    def from_proto(cls, msg: Any) -> WeightManifest:
        return cls(
            version=int(msg.version),
            checksum=str(msg.checksum),
            num_tensors=int(msg.num_tensors),
            total_bytes=int(msg.total_bytes),
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "format_version": self.format_version,
                "version": self.version,
                "checksum": self.checksum,
                "num_tensors": self.num_tensors,
                "total_bytes": self.total_bytes,
                "files": list(self.files),
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> WeightManifest:
        try:
            raw = json.loads(text)
            manifest = cls(
                version=int(raw["version"]),
                checksum=str(raw["checksum"]),
                num_tensors=int(raw["num_tensors"]),
                total_bytes=int(raw["total_bytes"]),
                format_version=int(raw.get("format_version", FORMAT_VERSION)),
                files=tuple(raw.get("files", ())),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"unreadable weight manifest: {exc}") from exc
        if manifest.format_version != FORMAT_VERSION:
            raise WeightsError(
                f"weight manifest format_version={manifest.format_version}, "
                f"this build reads {FORMAT_VERSION}"
            )
        return manifest


def sorted_named_tensors(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """`(name, tensor)` pairs in name order, the order every transport sends tensors in;
    raises `WeightsError` when a name appears twice."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    out = sorted(((str(k), v) for k, v in items), key=lambda kv: kv[0])
    for a, b in zip(out, out[1:], strict=False):
        if a[0] == b[0]:
            raise WeightsError(f"tensor name {a[0]!r} appears twice")
    return out


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's contents as little-endian C-order bytes (a copy only when needed)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def _checksum_header(name: str, dtype: str, shape: Sequence[int]) -> bytes:
    if "\x00" in name:
        raise WeightsError(f"tensor name {name!r} contains a NUL byte")
    return b"%s\x00%s\x00%s\x00" % (
        name.encode("utf-8"),
        dtype.encode(),
        ",".join(str(int(d)) for d in shape).encode(),
    )


def state_dict_checksum(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> str:
    """Hex SHA-256 over the tensors in name order.

    Each tensor contributes `name \\0 dtype \\0 d0,d1,... \\0` then its little-endian
    C-order bytes. The data length is fixed by dtype and shape, so the encoding is
    unambiguous. Device and memory layout do not change the result; dtype does.
    """
    h = hashlib.sha256()
    for name, tensor in sorted_named_tensors(named_tensors):
        h.update(_checksum_header(name, dtype_name(tensor.dtype), tensor.shape))
        h.update(tensor_bytes(tensor))
    return h.hexdigest()


def tensor_specs(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[TensorSpec]:
    """Specs in name order: the order every transport sends tensors in."""
    return [TensorSpec.of(name, t) for name, t in sorted_named_tensors(named_tensors)]


def make_manifest(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    version: int,
) -> WeightManifest:
    """Manifest (checksum, counts) of `named_tensors` becoming `version`."""
    items = sorted_named_tensors(named_tensors)
    return WeightManifest(
        version=int(version),
        checksum=state_dict_checksum(items),
        num_tensors=len(items),
        total_bytes=sum(TensorSpec.of(n, t).nbytes for n, t in items),
    )


def verify(named_tensors: Mapping[str, torch.Tensor], manifest: WeightManifest) -> None:
    """Raise `WeightsError` unless `named_tensors` match the manifest's counts and checksum."""
    if len(named_tensors) != manifest.num_tensors:
        raise WeightsError(
            f"partial update: got {len(named_tensors)} tensors, manifest says {manifest.num_tensors}"
        )
    got = state_dict_checksum(named_tensors)
    if got != manifest.checksum:
        raise WeightsError(
            f"checksum mismatch: computed {got[:16]}..., manifest says {manifest.checksum[:16]}..."
        )


DEFAULT_MAX_WEIGHT_BYTES = 64 << 30
"""Cap of one weight update a receiver accepts unless told otherwise (64 GiB: a 32B model in
bf16); see `rollout.max_weight_bytes`."""


def check_update_size(
    manifest: WeightManifest, specs: Sequence[TensorSpec] | None, max_bytes: int
) -> None:
    """Raise WeightsError unless an update announced by `manifest` (and `specs`, when the
    transport sends them up front) is bounded: total_bytes > 0, at most `max_bytes`, and
    equal to the sum of the specs' sizes. Every transport checks this before it allocates."""
    total = manifest.total_bytes
    if total <= 0:
        raise WeightsError(f"manifest total_bytes={total}: an update must announce its size")
    if total > max_bytes:
        raise WeightsError(
            f"manifest total_bytes={total} exceeds the limit {max_bytes} (rollout.max_weight_bytes)"
        )
    if specs is not None:
        announced = sum(spec.nbytes for spec in specs)
        if announced != total:
            raise WeightsError(
                f"the tensor specs hold {announced} bytes, the manifest's total_bytes is {total}"
            )


def named_parameters_for_update(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a weight update carries for an HF model: `named_parameters()` (tied
    parameters appear once, under their first name), detached."""
    return {name: p.detach() for name, p in model.named_parameters()}
