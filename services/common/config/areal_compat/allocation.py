"""AReaL's allocation strings (`fsdp:d4p1t1`, `sglang:d2t4`): the backend and the
parallel dimensions, from which the trainer's ranks and the rollout's replicas follow."""

from __future__ import annotations

import re
from dataclasses import dataclass

_DIM = re.compile(r"([dptce])(\d+)")


@dataclass(frozen=True)
class Allocation:
    """One AReaL allocation `backend:dims` (`fsdp:d4p1t1`, `sglang:d2t4`)."""

    backend: str
    dims: dict[str, int]

    @property
    def world(self) -> int:
        """GPUs the allocation spans (d·p·t·c, AReaL's world size)."""
        d = self.dims
        return d.get("d", 1) * d.get("p", 1) * d.get("t", 1) * d.get("c", 1)


def parse_allocation(text: str, default_backend: str) -> Allocation:
    """Parse `backend:dims` (AReaL 2.0) or `backend.dims` (older) or bare `dims`. The
    hybrid MoE form `backend:(attn:d1p6t1c1|ffn:...)` counts the attention part's GPUs."""
    text = text.strip()
    backend, dims_text = default_backend, text
    head = re.match(r"^([a-z_]+)(?:\[[^\]]*\])?[:.](.*)$", text)
    if head:
        backend, dims_text = head.group(1), head.group(2)
    hybrid = re.match(r"^\((?:attn:)?([^|)]*)", dims_text)
    if hybrid:
        dims_text = hybrid.group(1)
    dims = {k: int(v) for k, v in _DIM.findall(dims_text)}
    if not dims:
        raise ValueError(f"cannot read the parallel dimensions of {text!r} (expected e.g. d4p1t1)")
    return Allocation(backend, dims)
