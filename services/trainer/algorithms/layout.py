"""Per-token tensors in two layouts, and the per-sequence reductions both need.

Padded: every per-token tensor is `[B, T]`, row b is sequence b, positions past a
sequence's end are padding (their `loss_mask` is 0). Packed: every per-token tensor is
`[N]`, the sequences laid end to end, and `cu_seqlens` (`[B + 1]`, starting at 0, ending at
N) marks where sequence i occupies `[cu_seqlens[i], cu_seqlens[i+1])`.

Everything that reduces over a sequence (GSPO ratios, sequence-level rejection sampling,
`seq-mean-token-mean`, normalisation statistics) goes through `seq_sum` / `seq_broadcast`
here, so the two layouts give the same numbers by construction (and a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SeqLayout:
    """How positions of a per-token tensor map to sequences."""

    n_seqs: int
    shape: torch.Size
    cu_seqlens: Tensor | None
    seq_index: Tensor | None  # packed only: sequence id of every position, [N]

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None


def check_cu_seqlens(cu_seqlens: Tensor, total: int) -> Tensor:
    """Validate `cu_seqlens` against the packed length `total`; return it as int64."""
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [B+1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    if int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must end at the packed length {total}, got {int(cu[-1])}")
    if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    return cu


def layout_of(x: Tensor, cu_seqlens: Tensor | None = None) -> SeqLayout:
    """Describe the layout of per-token tensor `x` (2-D padded, or 1-D with `cu_seqlens`)."""
    if cu_seqlens is None:
        if x.ndim != 2:
            raise ValueError(
                f"per-token tensors must be 2-D [B, T] (padded) or 1-D [N] with cu_seqlens "
                f"(packed); got shape {tuple(x.shape)} without cu_seqlens"
            )
        return SeqLayout(n_seqs=x.shape[0], shape=x.shape, cu_seqlens=None, seq_index=None)
    if x.ndim != 1:
        raise ValueError(
            f"with cu_seqlens the per-token tensors must be 1-D packed [N]; got {tuple(x.shape)}"
        )
    cu = check_cu_seqlens(cu_seqlens.to(x.device), x.shape[0])
    n = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    seq_index = torch.repeat_interleave(torch.arange(n, device=x.device), lengths)
    return SeqLayout(n_seqs=n, shape=x.shape, cu_seqlens=cu, seq_index=seq_index)


def check_same_shape(layout: SeqLayout, **tensors: Tensor | None) -> None:
    """Every given per-token tensor must have the layout's shape; errors name the field."""
    for name, t in tensors.items():
        if t is not None and t.shape != layout.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but loss_mask has {tuple(layout.shape)}; "
                "all per-token tensors must share one layout"
            )


def check_per_seq(layout: SeqLayout, **tensors: Tensor | None) -> None:
    """Every given per-sequence tensor must be `[B]`; errors name the field."""
    for name, t in tensors.items():
        if t is not None and (t.ndim != 1 or t.shape[0] != layout.n_seqs):
            raise ValueError(
                f"{name} must be per-sequence with shape [{layout.n_seqs}], got {tuple(t.shape)}"
            )


def seq_sum(values: Tensor, layout: SeqLayout, dtype: torch.dtype | None = None) -> Tensor:
    """Sum of `values` over each sequence's positions → `[B]` (mask before calling).

    `dtype` accumulates in another precision (e.g. float64 statistics of float32 inputs)
    without materialising a converted copy of a padded batch."""
    if layout.seq_index is None:
        return values.sum(dim=-1, dtype=dtype)
    src = values if dtype is None else values.to(dtype)
    out = torch.zeros(layout.n_seqs, dtype=src.dtype, device=values.device)
    return out.index_add(0, layout.seq_index, src)


def seq_max(values: Tensor, layout: SeqLayout, fill: float) -> Tensor:
    """Max of `values` over each sequence's positions → `[B]`; empty sequences get `fill`."""
    if layout.seq_index is None:
        if values.shape[-1] == 0:
            return torch.full((layout.n_seqs,), fill, dtype=values.dtype, device=values.device)
        return values.max(dim=-1).values
    out = torch.full((layout.n_seqs,), fill, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, layout.seq_index, values, reduce="amax", include_self=True)


def seq_broadcast(per_seq: Tensor, layout: SeqLayout) -> Tensor:
    """Give every position the value of its sequence (`[B]` → layout shape)."""
    if layout.seq_index is None:
        return per_seq.unsqueeze(-1).expand(layout.shape)
    return per_seq[layout.seq_index]


def packed_to_padded(x: Tensor, cu_seqlens: Tensor, fill: float | int | bool = 0) -> Tensor:
    """`[N]` packed → `[B, max_len]` padded with `fill` (right padding)."""
    cu = check_cu_seqlens(cu_seqlens.to(x.device), x.shape[0])
    lengths = cu[1:] - cu[:-1]
    n = lengths.numel()
    max_len = int(lengths.max()) if n else 0
    out = torch.full((n, max_len), fill, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    seq_index = torch.repeat_interleave(torch.arange(n, device=x.device), lengths)
    offsets = torch.arange(x.shape[0], device=x.device) - cu[:-1][seq_index]
    out[seq_index, offsets] = x
    return out


def padded_to_packed(x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """`[B, T]` right-padded → (`[N]` packed, `cu_seqlens`), keeping `lengths[b]` per row."""
    if x.ndim != 2:
        raise ValueError(f"expected a padded [B, T] tensor, got {tuple(x.shape)}")
    lengths = lengths.to(device=x.device, dtype=torch.int64)
    if lengths.shape != (x.shape[0],):
        raise ValueError(f"lengths must be [{x.shape[0]}], got {tuple(lengths.shape)}")
    if bool((lengths < 0).any()) or bool((lengths > x.shape[1]).any()):
        raise ValueError(f"lengths must lie in [0, {x.shape[1]}]")
    keep = torch.arange(x.shape[1], device=x.device).unsqueeze(0) < lengths.unsqueeze(1)
    cu = torch.zeros(x.shape[0] + 1, dtype=torch.int64, device=x.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return x[keep], cu
