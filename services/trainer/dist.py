"""The trainer's view of torch.distributed: who am I, which backend, and how ranks agree.

Every rank runs the same code. Rank 0 alone talks to the buffer, the rollout replicas and
gRPC clients; what it learns (a batch, a stop request, a checkpoint request) reaches the
other ranks through the small helpers here, as bytes or JSON in tensors (never pickle, so
`broadcast_object_list` is not used).

Backends: gloo on CPU; on CUDA the group is created as "cpu:gloo,cuda:nccl" so that the
control messages (CPU tensors) go over gloo while parameters and gradients go over NCCL.

A single-process caller (tests, benchmarks, an in-process loop) gets a one-rank group on a
free loopback port, so FSDP2 and checkpointing run the same code path as N ranks.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

log = logging.getLogger(__name__)

# torchrun's environment contract; our own launcher sets the same variables.
RANK_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class DistContext:
    """What a rank needs to know about the job it belongs to."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    mesh: DeviceMesh
    # True when this module created the group (and so must destroy it).
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_as_rank() -> bool:
    """True when the environment describes one rank of a job (torchrun or our launcher)."""
    return all(k in os.environ for k in RANK_ENV)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def resolve_device(preference: str, local_rank: int) -> torch.device:
    """`auto` picks CUDA when present; asking for `cuda` without a GPU is an error."""
    pref = (preference or "auto").lower()
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    if pref.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "trainer.device is 'cuda' but no CUDA device is visible; "
                "set trainer.device=cpu (gloo) or auto"
            )
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    if pref != "cpu":
        raise ValueError(f"trainer.device={preference!r}: expected 'auto', 'cpu' or 'cuda'")
    return torch.device("cpu")


def _backend(dev: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """Join (or create) the trainer's process group and build the 1-D FSDP device mesh.

    Uses the torchrun environment when present; otherwise a one-rank group on a free
    loopback port. An already initialised default group is reused as it is.
    """
    owns = False
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if launched_as_rank():
            local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
            dev = resolve_device(device, local_rank)
            dist.init_process_group(backend=_backend(dev), timeout=timeout)
        else:
            # One rank on a free loopback port, without touching os.environ: child
            # processes of this one must not mistake themselves for ranks of this group.
            local_rank = 0
            dev = resolve_device(device, local_rank)
            dist.init_process_group(
                backend=_backend(dev),
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
        backend = _backend(dev)
        owns = True
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        dev = resolve_device(device, local_rank)
        backend = str(dist.get_backend())
    world = dist.get_world_size()
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    return DistContext(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=local_rank,
        device=dev,
        backend=backend,
        mesh=mesh,
        owns_group=owns,
    )


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """Send `data` from `src` to every rank (others pass None). Two broadcasts: size, bytes."""
    rank = dist.get_rank()
    size = torch.zeros(1, dtype=torch.int64)
    if rank == src:
        if data is None:
            raise ValueError("broadcast_bytes: the source rank must pass bytes")
        size[0] = len(data)
    dist.broadcast(size, src)
    n = int(size.item())
    if n == 0:
        return b""
    if rank == src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # type: ignore[arg-type]
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src)
    return data if rank == src else bytes(buf.numpy().tobytes())  # type: ignore[return-value]


def broadcast_json(obj: Any, src: int = 0) -> Any:
    """JSON from `src` to every rank (others pass anything; their value is ignored)."""
    payload = json.dumps(obj).encode() if dist.get_rank() == src else None
    return json.loads(broadcast_bytes(payload, src).decode())


def finish(code: int, ctx: DistContext | None = None) -> None:
    """End a rank so that its exit status is the truth.

    After gloo work, letting the interpreter tear down can abort (a C++ destructor racing
    with atexit handlers), turning a clean run into exit 134. So: flush, destroy the group
    we created, and leave with `os._exit`, skipping interpreter finalisation.
    """
    try:
        if dist.is_initialized() and (ctx is None or ctx.owns_group):
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - we are exiting; report and go
        log.exception("destroy_process_group failed")
        code = code or 1
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
