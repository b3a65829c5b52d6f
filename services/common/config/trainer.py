"""Trainer block: ranks, checkpoints, recovery and weight transport."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import FlywheelModel


class TrainerConfig(FlywheelModel):
    """How the trainer process group runs; the algorithm itself lives in `actor`."""

    n_ranks: int = Field(default=1, ge=1)
    """Data-parallel ranks (processes) of the trainer; FSDP shards over them."""

    backend: Literal["gloo", "nccl"] = "gloo"
    """torch.distributed backend: gloo on CPU, nccl on GPUs."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; `auto` picks cuda when available."""

    master_addr: str = "127.0.0.1"
    """Rendezvous address of rank 0."""

    master_port: int = Field(default=0, ge=0, le=65535)
    """Rendezvous port of rank 0; 0 picks a free port."""

    save_freq_steps: int | None = Field(default=50, ge=1)
    """Checkpoint every this many steps; null disables step checkpoints."""

    checkpoint_dir: str | None = None
    """Checkpoint directory; null means `<cluster.fileroot>/<experiment>/<trial>/checkpoints`."""

    keep_last_checkpoints: int = Field(default=2, ge=1)
    """Older checkpoints beyond this many are deleted."""

    recover: Literal["auto", "disabled"] = "auto"
    """Resume from the latest complete checkpoint if one exists (`auto`), or start fresh."""

    weight_transport: Literal["disk", "distributed", "grpc"] = "disk"
    """How new weights reach rollout replicas: a safetensors file on shared disk, a
    torch.distributed broadcast, or streamed over gRPC."""

    weight_dir: str | None = None
    """Directory of published weights (`disk`); null means
    `<cluster.fileroot>/<experiment>/<trial>/weights`."""

    batch_timeout: float = Field(default=3600.0, gt=0.0)
    """Seconds to wait for a training batch from the buffer before giving up."""

    metrics_jsonl: str | None = None
    """File receiving one JSON line of training stats per step; null means
    `<cluster.fileroot>/<experiment>/<trial>/metrics.jsonl`."""

    log_every_steps: int = Field(default=1, ge=1)
    """Log training stats every this many steps."""
