"""The torch.distributed transport: byte buckets broadcast over a group of their own.

The fastest path between a trainer and co-scheduled replicas: the trainer's rank 0 and the
replicas join a `WeightsGroup` (built the way SGLang builds its weight-update group, so the
same sender feeds either engine) and broadcast the tensors, packed into byte buckets both
sides derive from the same specs. The manifest travels beside the broadcast, over gRPC.

The two-level fan-out (`trainer.weight_fanout: two_level`) uses the same groups twice: the
trainer broadcasts to one relay replica per node, and each relay re-broadcasts what it
receives, bucket by bucket, as rank 0 of its node's group (`relay_buckets`). There the
trainer hosts one store for every group (`host_store`), each group under a prefix of its
own name, so a relay that is rank 0 of its node group connects to it like any member.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.common.weights.manifest import (
    TensorSpec,
    WeightsError,
    tensor_specs,
    torch_dtype,
)

DEFAULT_BUCKET_BYTES = 64 << 20


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
    """Split a uint8 buffer back into the bucket's tensors: views of `flat`, or a copy
    where a tensor starts at an offset its dtype cannot be viewed at (a float32 after an
    odd number of bfloat16 values)."""
    if flat.numel() != bucket.nbytes:
        raise WeightsError(f"bucket buffer has {flat.numel()} bytes, expected {bucket.nbytes}")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for spec in bucket.specs:
        raw = flat[offset : offset + spec.nbytes]
        dtype = torch_dtype(spec.dtype)
        if offset % dtype.itemsize:
            raw = raw.clone()
        out[spec.name] = raw.view(dtype).reshape(spec.shape)
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
        store: Any | None = None,
        remote_store: bool = False,
    ) -> None:
        """`store`: a store this process already holds (the trainer's `host_store`), used
        under the prefix `group_name` instead of a rendezvous. `remote_store`: rank 0 too
        connects to a store another process hosts at `master_address:master_port` (a relay
        is rank 0 of its node group, the trainer hosts the store)."""
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
            master_address,
            master_port,
            rank,
            world_size,
            backend,
            group_name,
            timeout_s,
            store=store,
            remote_store=remote_store,
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._pg.broadcast(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Start a broadcast and return its work handle (`.wait()` ends it); broadcasts
        started one after another run in that order on every rank."""
        return self._pg.broadcast(tensor, src)

    def release(self) -> None:
        """Destroy the group on this process only (no collective, unlike `close`): for a
        group the other members have left or are leaving, where a barrier would wait for
        nobody. Its connections close, so a peer still blocked in it fails instead of
        waiting for its timeout, and its name can be used again."""
        import torch.distributed as dist

        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(ValueError, RuntimeError, AssertionError, KeyError):
                dist.destroy_process_group(pg)

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


def host_store(port: int, timeout_s: float = 300.0) -> Any:
    """A TCP store server on `port` (all interfaces) that outlives any one group: the
    two-level fan-out's groups (the trainer's and every node's) rendezvous in it, each
    under its own name, so a node group can be re-formed while the others keep running."""
    import torch.distributed as dist

    return dist.TCPStore(
        "0.0.0.0",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _new_group(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    name: str,
    timeout_s: float,
    *,
    store: Any | None = None,
    remote_store: bool = False,
) -> Any:
    import inspect

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None and rank == 0 and remote_store:
        store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    elif store is None:
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


@dataclass
class RelayResult:
    """What a relay received (the whole update, as `recv_buckets` returns it) and whether
    every bucket also went down to its node group (`forward_error` None)."""

    tensors: dict[str, torch.Tensor]
    forward_error: Exception | None


def relay_buckets(
    upstream: WeightsGroup,
    downstream: WeightsGroup,
    specs: Sequence[TensorSpec],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> RelayResult:
    """A relay's side of the two-level fan-out: receive every bucket from rank 0 of
    `upstream` (the trainer) and re-broadcast it as rank 0 of `downstream` (its node).

    Pipelined: bucket k's downstream broadcast is started (asynchronously, in order) as
    soon as it has arrived, and the relay goes on receiving bucket k+1 meanwhile. The
    upstream receive never waits for the downstream, so a slow or dead member of the node
    cannot hold up the trainer's broadcast to the other relays; a downstream failure is
    returned (`forward_error`), not raised, because the relay's own copy is complete.
    The buffers are the received ones, so no bucket is copied twice.
    """
    out: dict[str, torch.Tensor] = {}
    works: list[Any] = []
    error: Exception | None = None

    def forward(t: torch.Tensor) -> None:
        nonlocal error
        if error is None:
            try:
                works.append(downstream.broadcast_async(t, 0))
            except Exception as exc:  # noqa: BLE001 - reported with the result
                error = exc

    if bucket_bytes == 0:
        for spec in specs:
            t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=upstream.device)
            upstream.broadcast(t, 0)
            forward(t)
            out[spec.name] = t
    else:
        for bucket in make_buckets(list(specs), bucket_bytes):
            flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=upstream.device)
            upstream.broadcast(flat, 0)
            forward(flat)
            out.update(unflatten_bucket(bucket, flat))
    for work in works:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - the first failure is the one reported
            error = error or exc
    return RelayResult(out, error)
