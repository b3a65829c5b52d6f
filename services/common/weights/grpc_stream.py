"""The gRPC transport: an update streamed as `WeightChunk` messages and reassembled.

When trainer and replica share neither a volume nor a process group, the update goes over
the rollout service's own gRPC API: tensors in name order, cut into bounded chunks, the
manifest in the first one. The receiver bounds the stream by the manifest before it buffers
anything and verifies the checksum before the weights are applied.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from services.common.weights.manifest import (
    DEFAULT_MAX_WEIGHT_BYTES,
    TensorSpec,
    WeightManifest,
    WeightsError,
    check_update_size,
    sorted_named_tensors,
    tensor_bytes,
    torch_dtype,
    verify,
)

DEFAULT_CHUNK_BYTES = 4 << 20


def iter_weight_chunks(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    manifest: WeightManifest,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    request_id: str = "",
) -> Iterator[Any]:
    """Yield `rollout_pb2.WeightChunk`s: tensors in name order, each cut into pieces of at
    most `chunk_bytes`; the first chunk carries the manifest and every chunk the request id.
    A tensor with no elements is sent as one empty chunk so the receiver still sees it."""
    from flywheel_proto.v1 import rollout_pb2

    if chunk_bytes <= 0:
        raise WeightsError(f"chunk_bytes must be positive, got {chunk_bytes}")
    first = True
    for name, tensor in sorted_named_tensors(named_tensors):
        spec = TensorSpec.of(name, tensor)
        data = tensor_bytes(tensor)
        offsets = range(0, len(data), chunk_bytes) if len(data) else [0]
        for off in offsets:
            msg = rollout_pb2.WeightChunk(
                request_id=request_id,
                name=name,
                dtype=spec.dtype,
                shape=list(spec.shape),
                offset=off,
                data=bytes(data[off : off + chunk_bytes]),
            )
            if first:
                msg.manifest.CopyFrom(manifest.to_proto())
                first = False
            yield msg
    if first:
        raise WeightsError("no tensors to send")


class WeightAssembler:
    """Receiver side of `iter_weight_chunks`: add chunks in order, then `finish()`.

    Chunks of one tensor must arrive in order and contiguously (gRPC streams are ordered);
    anything else (gap, overrun, changed dtype/shape, missing manifest) raises at once.
    """

    def __init__(self, max_total_bytes: int = DEFAULT_MAX_WEIGHT_BYTES) -> None:
        self.manifest: WeightManifest | None = None
        self.request_id = ""
        self._max_total = max_total_bytes
        self._announced = 0  # sum of the sizes of the tensors seen so far
        self._tensors: dict[str, bytearray] = {}
        self._specs: dict[str, TensorSpec] = {}
        self._current: str | None = None
        self._received = 0

    def add(self, chunk: Any) -> None:
        if self.manifest is None:
            if not chunk.HasField("manifest"):
                raise WeightsError("the first weight chunk must carry the manifest")
            manifest = WeightManifest.from_proto(chunk.manifest)
            check_update_size(manifest, None, self._max_total)
            self.manifest = manifest
            self.request_id = chunk.request_id
        name = chunk.name
        if not name:
            raise WeightsError("weight chunk without a tensor name")
        if name != self._current:
            if name in self._tensors:
                raise WeightsError(f"chunks of tensor {name!r} are not contiguous in the stream")
            spec = TensorSpec.from_proto(chunk)
            self._announced += spec.nbytes
            if self._announced > self.manifest.total_bytes:
                raise WeightsError(
                    f"the tensors' shapes hold more than the manifest's total_bytes="
                    f"{self.manifest.total_bytes}"
                )
            self._specs[name] = spec
            self._tensors[name] = bytearray()
            self._current = name
        spec = self._specs[name]
        if chunk.dtype != spec.dtype or tuple(chunk.shape) != spec.shape:
            raise WeightsError(f"tensor {name!r}: dtype/shape changed between chunks")
        buf = self._tensors[name]
        if chunk.offset != len(buf):
            raise WeightsError(
                f"tensor {name!r}: chunk at offset {chunk.offset}, expected {len(buf)}"
            )
        if len(buf) + len(chunk.data) > spec.nbytes:
            raise WeightsError(f"tensor {name!r}: more bytes than its shape holds ({spec.nbytes})")
        self._received += len(chunk.data)
        if self._received > self.manifest.total_bytes:
            raise WeightsError(
                f"stream carries more than the manifest's total_bytes={self.manifest.total_bytes}"
            )
        buf.extend(chunk.data)

    def finish(self) -> tuple[dict[str, torch.Tensor], WeightManifest]:
        """Tensors and manifest, after checking completeness and checksum."""
        if self.manifest is None:
            raise WeightsError("empty weight stream: no manifest received")
        check_update_size(self.manifest, list(self._specs.values()), self._max_total)
        out: dict[str, torch.Tensor] = {}
        for name, buf in self._tensors.items():
            spec = self._specs[name]
            if len(buf) != spec.nbytes:
                raise WeightsError(
                    f"partial update: tensor {name!r} has {len(buf)} of {spec.nbytes} bytes"
                )
            flat = (
                torch.frombuffer(buf, dtype=torch.uint8)
                if buf
                else torch.empty(0, dtype=torch.uint8)
            )
            out[name] = flat.view(torch_dtype(spec.dtype)).reshape(spec.shape)
        verify(out, self.manifest)
        return out, self.manifest
