"""Mean/std normalisation of rewards and advantages (AReaL's `NormConfig`).

    out = (x - baseline) / (std + eps)        (each part optional)

`mean_level` / `std_level` choose where the statistics come from:

* `batch`: every valid element of the batch counts once. For per-token inputs an element is
  a token (standard advantage whitening); for per-sequence inputs (rewards) a sequence.
  With a `process_group` the sums are all-reduced, so every data-parallel rank gets the
  statistics of the global batch.
* `group`: the sequences that share a group id (the samples of one prompt). Each sequence
  counts once, through the mean of its valid tokens: this is the per-completion baseline
  of GRPO, Dr.GRPO and RLOO. (AReaL weighs group statistics by token count, which biases
  the baseline towards long completions when lengths differ; Flywheel does not.) Groups
  must be whole on one rank, which the buffer guarantees.
* `None`: no centring / no scaling.

`mean_leave1out` centres each sequence on the mean of the *other* elements (its own tokens
excluded at batch level, its own completion excluded at group level). A sequence with no
peer (a group of one) has no baseline: its normalised value is 0, never a division by 0.
The standard deviation is that of `x` at `std_level` (around that level's own mean), with
`n - 1` when `std_unbiased`; a single element has std 0.

Group boundaries come from per-sequence group ids (groups may be unequal after filtering);
`group_size` is only a fixed-stride fallback when no ids are given.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from .layout import SeqLayout, check_per_seq, layout_of, seq_broadcast, seq_sum

Level = Literal["batch", "group"] | None
_LEVELS = ("batch", "group", None)


class NormLike(Protocol):
    """Anything with `NormConfig`'s fields (the pydantic config, or `NormSpec`)."""

    @property
    def mean_level(self) -> Any: ...
    @property
    def mean_leave1out(self) -> bool: ...
    @property
    def std_level(self) -> Any: ...
    @property
    def std_unbiased(self) -> bool: ...
    @property
    def eps(self) -> float: ...
    @property
    def group_size(self) -> int: ...


@dataclass(frozen=True)
class NormSpec:
    """Plain-Python twin of `NormConfig` (AReaL defaults), for callers without a config."""

    mean_level: Level = "batch"
    mean_leave1out: bool = False
    std_level: Level = "batch"
    std_unbiased: bool = True
    eps: float = 1e-5
    group_size: int = 1


def group_index_from_ids(
    group_ids: Sequence[Hashable] | Tensor | None,
    n_seqs: int,
    group_size: int | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Dense group index `[B]` (0..G-1, in order of first appearance) from per-sequence ids.

    Without ids, consecutive runs of `group_size` sequences form the groups; a batch that
    does not divide evenly is an error rather than a silently wrong grouping.
    """
    if group_ids is not None:
        if isinstance(group_ids, Tensor):
            if group_ids.ndim != 1 or group_ids.shape[0] != n_seqs:
                raise ValueError(
                    f"group_ids must be per-sequence [{n_seqs}], got {tuple(group_ids.shape)}"
                )
            ids = group_ids.tolist()
        else:
            ids = list(group_ids)
            if len(ids) != n_seqs:
                raise ValueError(f"group_ids has {len(ids)} entries for {n_seqs} sequences")
        dense: dict[Hashable, int] = {}
        index = [dense.setdefault(g, len(dense)) for g in ids]
        return torch.tensor(index, dtype=torch.int64, device=device)
    if group_size is None or group_size < 1:
        raise ValueError(
            "group-level normalisation needs group_ids (from the batch) or group_size >= 1"
        )
    if n_seqs % group_size != 0:
        raise ValueError(
            f"batch of {n_seqs} sequences does not split into groups of group_size={group_size}; "
            "pass group_ids from the batch metadata (groups may be unequal after filtering)"
        )
    return torch.arange(n_seqs, device=device) // group_size


def _all_reduce(t: Tensor, process_group: Any) -> Tensor:
    if process_group is None:
        return t
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=process_group)
    return t


def _check_norm(norm: NormLike) -> None:
    for field in ("mean_level", "std_level"):
        level = getattr(norm, field)
        if level not in _LEVELS:
            raise ValueError(f"{field} must be 'batch', 'group' or null, got {level!r}")
    if norm.mean_leave1out and norm.mean_level is None:
        raise ValueError("mean_leave1out=true needs a mean_level ('batch' or 'group')")
    if not norm.eps > 0:
        raise ValueError(f"eps must be > 0, got {norm.eps!r}")


@dataclass
class _Summary:
    """Per-sequence sufficient statistics in float64."""

    total: Tensor  # [B] sum of valid values
    count: Tensor  # [B] number of valid elements
    valid_seq: Tensor  # [B] bool, count > 0

    @property
    def seq_mean(self) -> Tensor:
        return self.total / self.count.clamp(min=1)


def _group_stats(
    summary: _Summary, group_index: Tensor, n_groups: int, unbiased: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sequence (group mean, group std, group n, group sum of sequence means)."""
    m = torch.where(summary.valid_seq, summary.seq_mean, 0.0)
    w = summary.valid_seq.to(torch.float64)
    g_n = torch.zeros(n_groups, dtype=torch.float64, device=m.device).index_add(0, group_index, w)
    g_sum = torch.zeros_like(g_n).index_add(0, group_index, m)
    g_mean = g_sum / g_n.clamp(min=1)
    dev = torch.where(summary.valid_seq, m - g_mean[group_index], 0.0)
    g_ss = torch.zeros_like(g_n).index_add(0, group_index, dev.square())
    denom = g_n - 1 if unbiased else g_n
    g_std = torch.where(denom > 0, (g_ss / denom.clamp(min=1)).sqrt(), 0.0)
    return g_mean[group_index], g_std[group_index], g_n[group_index], g_sum[group_index]


def normalize(
    x: Tensor,
    mask: Tensor | None = None,
    *,
    mean_level: Level = "batch",
    std_level: Level = "batch",
    mean_leave1out: bool = False,
    std_unbiased: bool = True,
    eps: float = 1e-5,
    group_ids: Sequence[Hashable] | Tensor | None = None,
    group_size: int | None = None,
    cu_seqlens: Tensor | None = None,
    process_group: Any = None,
) -> Tensor:
    """Normalise `x` as the module docstring describes; returns float32, 0 where masked.

    `x` is per-sequence `[B]` (rewards), per-token `[B, T]` (padded) or per-token `[N]` with
    `cu_seqlens` (packed). `mask` has `x`'s shape (default: all valid). `process_group`, when
    given, all-reduces the batch-level sums across data-parallel ranks (it is the only
    collective in the algorithm core).
    """
    spec = NormSpec(mean_level, mean_leave1out, std_level, std_unbiased, eps, group_size or 1)
    _check_norm(spec)
    if mask is None:
        mask = torch.ones_like(x, dtype=torch.bool)
    if mask.shape != x.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but x has {tuple(x.shape)}")
    valid = mask.to(torch.bool)
    # float32 element-wise, float64 accumulation: no float64 copy of a [B, T] batch.
    xf = torch.where(valid, x.detach().to(torch.float32), 0.0)
    f64 = torch.float64

    per_sequence = x.ndim == 1 and cu_seqlens is None
    layout: SeqLayout | None = None
    if per_sequence:
        total, count = xf.to(f64), valid.to(f64)
        n_seqs = x.shape[0]
    else:
        layout = layout_of(x, cu_seqlens)
        total = seq_sum(xf, layout, dtype=f64)
        count = seq_sum(valid, layout, dtype=f64)
        n_seqs = layout.n_seqs
    summary = _Summary(total=total, count=count, valid_seq=count > 0)

    def per_elem(per_seq: Tensor) -> Tensor:
        return per_seq if layout is None else seq_broadcast(per_seq, layout)

    needs_group = "group" in (mean_level, std_level)
    group_index: Tensor | None = None
    if needs_group:
        group_index = group_index_from_ids(group_ids, n_seqs, group_size, device=x.device)
        n_groups = int(group_index.max()) + 1 if n_seqs else 0
        g_mean, g_std, g_n, g_sum = _group_stats(summary, group_index, n_groups, std_unbiased)

    needs_batch = "batch" in (mean_level, std_level)
    if needs_batch:
        b_sum = _all_reduce(total.sum().reshape(1), process_group)
        b_cnt = _all_reduce(count.sum().reshape(1), process_group)
        b_mean = b_sum / b_cnt.clamp(min=1)
        dev = torch.where(valid, xf - b_mean.to(torch.float32), 0.0)
        b_ss = _all_reduce(dev.square().sum(dtype=f64).reshape(1), process_group)
        b_denom = b_cnt - 1 if std_unbiased else b_cnt
        b_std = torch.where(b_denom > 0, (b_ss / b_denom.clamp(min=1)).sqrt(), 0.0)

    # Centre.
    if mean_level is None:
        centred = xf
    else:
        if mean_level == "batch":
            if mean_leave1out:
                others = b_cnt - count  # [B]
                baseline = (b_sum - total) / others.clamp(min=1)
                no_peer = others <= 0
            else:
                baseline = b_mean.expand(n_seqs)
                no_peer = torch.zeros(n_seqs, dtype=torch.bool, device=x.device)
        else:
            if mean_leave1out:
                others = g_n - 1
                baseline = (g_sum - torch.where(summary.valid_seq, summary.seq_mean, 0.0)) / (
                    others.clamp(min=1)
                )
                no_peer = others <= 0
            else:
                baseline = g_mean
                no_peer = torch.zeros(n_seqs, dtype=torch.bool, device=x.device)
        centred = torch.where(per_elem(no_peer), 0.0, xf - per_elem(baseline.to(torch.float32)))

    # Scale.
    if std_level is None:
        out = centred
    else:
        std = b_std.expand(n_seqs) if std_level == "batch" else g_std
        out = centred / (per_elem(std.to(torch.float32)) + eps)
    return torch.where(valid, out, 0.0)


def normalize_with(
    x: Tensor,
    norm: NormLike | None,
    mask: Tensor | None = None,
    *,
    group_ids: Sequence[Hashable] | Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    process_group: Any = None,
) -> Tensor:
    """`normalize` driven by a `NormConfig`/`NormSpec`; `None` returns `x` (masked) as is."""
    if norm is None:
        if mask is None:
            return x.to(torch.float32)
        return torch.where(mask.to(torch.bool), x, 0.0).to(torch.float32)
    _check_norm(norm)
    return normalize(
        x,
        mask,
        mean_level=norm.mean_level,
        std_level=norm.std_level,
        mean_leave1out=norm.mean_leave1out,
        std_unbiased=norm.std_unbiased,
        eps=norm.eps,
        group_ids=group_ids,
        group_size=norm.group_size,
        cu_seqlens=cu_seqlens,
        process_group=process_group,
    )


__all__ = [
    "NormLike",
    "NormSpec",
    "check_per_seq",
    "group_index_from_ids",
    "normalize",
    "normalize_with",
]
