"""The weight-update format shared by the trainer (sender) and the rollout (receiver).

A weight update is a set of named tensors (the Hugging Face parameter names of the policy,
tied parameters once) plus a manifest: the version the weights become and a SHA-256 checksum.
The same checksum is computed on both sides whatever the transport, so a receiver can refuse
a torn, truncated or corrupted update and keep serving the weights it had:

- disk: `save_weights(dir, tensors, version)` writes safetensors files and a JSON manifest;
  `load_weights(dir)` reads and verifies them.
- torch.distributed: tensors are flattened into byte buckets (`make_buckets`) and broadcast
  from the trainer's rank 0 over a group made by `init_weights_group` (gloo on CPU, NCCL on
  GPU); `send_buckets` / `recv_buckets` run the two sides with the same bucket plan.
- gRPC: `iter_weight_chunks` cuts the tensors into `WeightChunk` messages (the first one
  carries the manifest); `WeightAssembler` puts them back together and verifies them.

Tensors always travel as raw little-endian bytes with dtype and shape, never pickled.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
MANIFEST_FILE = "flywheel_weights.json"
DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_CHUNK_BYTES = 4 << 20

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


def _items(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]):
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
    for name, tensor in _items(named_tensors):
        h.update(_checksum_header(name, dtype_name(tensor.dtype), tensor.shape))
        h.update(tensor_bytes(tensor))
    return h.hexdigest()


def tensor_specs(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[TensorSpec]:
    """Specs in name order: the order every transport sends tensors in."""
    return [TensorSpec.of(name, t) for name, t in _items(named_tensors)]


def make_manifest(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    version: int,
) -> WeightManifest:
    """Manifest (checksum, counts) of `named_tensors` becoming `version`."""
    items = _items(named_tensors)
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


# --------------------------------------------------------------------------- disk


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
    items = _items(named_tensors)
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
            metadata={"flywheel_version": str(manifest.version)},
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


# ----------------------------------------------------------------- torch.distributed


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors (name order) flattened into one byte buffer for one broadcast."""

    specs: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def make_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Group specs, in the order given, into buckets of at most `bucket_bytes` bytes.

    A tensor larger than `bucket_bytes` gets a bucket of its own. Sender and receiver
    call this with the same specs and size, so they agree on every broadcast's length.
    """
    if bucket_bytes <= 0:
        raise WeightsError(
            f"bucket_bytes must be positive here, got {bucket_bytes} (0 = per-tensor broadcast "
            "is handled by send_buckets/recv_buckets)"
        )
    buckets: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not buckets or (size + spec.nbytes > bucket_bytes and buckets[-1]):
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += spec.nbytes
    return [Bucket(tuple(b)) for b in buckets]


def flatten_bucket(
    bucket: Bucket, tensors: Mapping[str, torch.Tensor], device: str | torch.device | None = None
) -> torch.Tensor:
    """Concatenate the bucket's tensors as raw bytes into one uint8 tensor."""
    parts = []
    for spec in bucket.specs:
        t = tensors[spec.name].detach()
        if device is not None:
            t = t.to(device)
        parts.append(t.contiguous().reshape(-1).view(torch.uint8))
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat(parts)


def unflatten_bucket(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Split a uint8 buffer back into the bucket's tensors (views of `flat`)."""
    if flat.numel() != bucket.nbytes:
        raise WeightsError(f"bucket buffer has {flat.numel()} bytes, expected {bucket.nbytes}")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for spec in bucket.specs:
        raw = flat[offset : offset + spec.nbytes]
        out[spec.name] = raw.view(torch_dtype(spec.dtype)).reshape(spec.shape)
        offset += spec.nbytes
    return out


class WeightsGroup:
    """A process group of the trainer's rank 0 (rank 0) and rollout replicas (1..N).

    Not the default group: the trainer's rank 0 already has one (its FSDP ranks) and a
    process can have only one. It is built the way SGLang's `/init_weights_update_group`
    builds its side (TCP rendezvous at `tcp://master_address:master_port`, a store prefixed
    with `group_name`, a group of its own), so the same sender code can feed Flywheel's torch
    engine and an SGLang server. Rank 0 hosts the store.
    """

    def __init__(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = "flywheel_weights",
        timeout_s: float = 300.0,
    ) -> None:
        if world_size < 2:
            raise WeightsError(f"world_size must be >= 2 (trainer + replicas), got {world_size}")
        if not 0 <= rank < world_size:
            raise WeightsError(f"rank {rank} is outside world_size {world_size}")
        if backend not in ("gloo", "nccl"):
            raise WeightsError(f"backend {backend!r} is not supported; use 'gloo' or 'nccl'")
        if backend == "nccl" and not torch.cuda.is_available():
            raise WeightsError("backend 'nccl' needs CUDA, which this process does not have")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.group_name = group_name
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self._pg: Any = _new_group(
            master_address, master_port, rank, world_size, backend, group_name, timeout_s
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._pg.broadcast(tensor, src).wait()

    def close(self) -> None:
        """Barrier then destroy the group; call on every rank (a collective)."""
        import torch.distributed as dist

        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            pg.barrier().wait()
        finally:
            # Not registered (fallback construction): dropping the object is enough.
            with contextlib.suppress(ValueError, RuntimeError, AssertionError):
                dist.destroy_process_group(pg)


def _new_group(
    address: str, port: int, rank: int, world_size: int, backend: str, name: str, timeout_s: float
) -> Any:
    import inspect

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(
        c10d.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = dist.PrefixStore(name, store)
    helper = getattr(c10d, "_new_process_group_helper", None)
    if helper is None:  # pragma: no cover - torch without the helper: a plain group object
        if backend == "nccl":
            # The binding gives `options` a default; torch's stub leaves it out.
            return dist.ProcessGroupNCCL(store, rank, world_size)  # type: ignore[call-arg]
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    params = inspect.signature(helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        store,
        group_name=name,
        timeout=timeout,
        **{options: None},
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def send_buckets(
    group: WeightsGroup,
    named_tensors: Mapping[str, torch.Tensor],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    src: int = 0,
) -> list[TensorSpec]:
    """Sender side: broadcast every bucket of `named_tensors` in name order; returns specs.

    `bucket_bytes=0` broadcasts each tensor on its own in its own dtype: the layout SGLang's
    `/update_weights_from_distributed` expects (use it when the replicas run SGLang).
    """
    specs = tensor_specs(named_tensors)
    if bucket_bytes == 0:
        for spec in specs:
            t = named_tensors[spec.name].detach().to(group.device).contiguous()
            group.broadcast(t, src)
        return specs
    for bucket in make_buckets(specs, bucket_bytes):
        flat = flatten_bucket(bucket, named_tensors, device=group.device)
        group.broadcast(flat, src)
    return specs


def recv_buckets(
    group: WeightsGroup,
    specs: Sequence[TensorSpec],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    src: int = 0,
) -> dict[str, torch.Tensor]:
    """Receiver side: the same bucket plan as `send_buckets`, filled by broadcast."""
    out: dict[str, torch.Tensor] = {}
    if bucket_bytes == 0:
        for spec in specs:
            t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=group.device)
            group.broadcast(t, src)
            out[spec.name] = t
        return out
    for bucket in make_buckets(list(specs), bucket_bytes):
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(flat, src)
        out.update(unflatten_bucket(bucket, flat))
    return out


# ---------------------------------------------------------------------------- gRPC


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
    for name, tensor in _items(named_tensors):
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


def check_weights_dir(directory: str | os.PathLike[str], max_bytes: int) -> WeightManifest:
    """The manifest of a weights directory, after checking that it and the files it names
    are within `max_bytes` (before any file is read into memory)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise WeightsError(f"weights directory {directory} does not exist")
    manifest = read_manifest(directory)
    check_update_size(manifest, None, max_bytes)
    files = [directory / f for f in manifest.files] or sorted(directory.glob("*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files if f.is_file())
    # safetensors adds a JSON header per file: allow it, not a second model.
    if on_disk > max_bytes + (1 << 20) * max(1, len(files)):
        raise WeightsError(
            f"{directory} holds {on_disk} bytes of weights, above "
            f"rollout.max_weight_bytes={max_bytes}"
        )
    return manifest


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


def named_parameters_for_update(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a weight update carries for an HF model: `named_parameters()` (tied
    parameters appear once, under their first name), detached."""
    return {name: p.detach() for name, p in model.named_parameters()}
