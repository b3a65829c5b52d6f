"""Mean/std normalisation of rewards and advantages (AReaL's `NormConfig`).

    out = (x - mean) / (std + eps)        on valid elements, 0 on masked ones

AReaL's semantics (AReaL 2.0 `areal/utils/data.py`, `Normalization`):

* **Elements.** Every valid element counts once: a sequence for per-sequence inputs
  (rewards `[B]`), a token with mask 1 for per-token inputs (advantages `[B, T]` or packed
  `[N]`), so a longer completion weighs more. `per_completion=True` (a Flywheel option)
  makes each completion one element instead, through the mean of its valid tokens.
* **mean** (`mean_level`): the mean of the valid elements of the batch (`batch`, all-reduced
  over `process_group`) or of the element's prompt group (`group`); 0 when null. With
  `mean_leave1out` each valid element's mean leaves out that one element:
  (S - x) / (n - 1); masked elements get the plain mean, and a batch/group with at most one
  valid element gets mean 0. A group of one sequence under leave-one-out is its own
  baseline (mean = x, so the output is 0; AReaL 1.0.4 used mean 0 there and passed x
  through; Flywheel follows 2.0).
* **std** (`std_level`): the root mean square of (x - mean) over the valid elements of the
  batch or group, with the *same per-element mean* that is subtracted (so with
  `mean_level: null` it is the RMS around 0), n - 1 in the denominator when `std_unbiased`.
  The std is 1 where it is undefined: one valid element (or none) when unbiased, none when
  biased, and a group of one sequence when unbiased. `std_level: null` means std 1 and eps 0.
* **Groups** come from per-sequence group ids (groups may be unequal after filtering);
  without ids, consecutive runs of `group_size` sequences, and the rows after the last full
  group belong to no group: their mean is 0 and their std 1 (AReaL divides them by eps,
  the blow-up its own docstring warns about; see docs/algorithms.md).
* A mask that sums to 0 returns the input unchanged (as float32).

Statistics are accumulated in float64 (AReaL's `high_precision`); the output is float32.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from .layout import check_per_seq, layout_of, seq_broadcast, seq_sum

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
    per_completion: bool = False


def group_index_from_ids(
    group_ids: Sequence[Hashable] | Tensor | None,
    n_seqs: int,
    group_size: int | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Dense group index `[B]` (0..G-1, in order of first appearance) from per-sequence ids.

    Without ids, consecutive runs of `group_size` sequences form the groups, and the rows
    after the last full group get -1 (no group), as AReaL's fixed-size slicing leaves them.
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
    rows = torch.arange(n_seqs, device=device)
    full = (n_seqs // group_size) * group_size
    return torch.where(rows < full, rows // group_size, -1)


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
    if not norm.eps >= 0:
        raise ValueError(f"eps must be >= 0, got {norm.eps!r}")


@dataclass(frozen=True)
class _Pool:
    """Which pool of elements each element's statistics come from.

    `index[e]` in 0..n-1 (the batch is pool 0), or -1 for an element in no pool; `single[e]`
    marks elements of a pool holding one sequence; `reduce` all-reduces pool sums."""

    index: Tensor
    n: int
    single: Tensor
    process_group: Any = None

    def sums(self, values: Tensor) -> Tensor:
        """Per-element sum of `values` over the element's pool (0 outside any pool)."""
        inside = self.index >= 0
        idx = self.index.clamp(min=0)
        per_pool = torch.zeros(max(self.n, 1), dtype=values.dtype, device=values.device)
        per_pool = per_pool.index_add(0, idx, torch.where(inside, values, 0.0))
        per_pool = _all_reduce(per_pool, self.process_group)
        return torch.where(inside, per_pool[idx], 0.0)


def _pool_mean(v: Tensor, w: Tensor, pool: _Pool, leave1out: bool) -> Tensor:
    total, count = pool.sums(v * w), pool.sums(w)
    inside = pool.index >= 0
    if leave1out:
        loo = (total - v * w) / (count - w).clamp(min=1.0)
        plain = total / count.clamp(min=1.0)
        mean = torch.where(w > 0, loo, plain)
        mean = torch.where(count <= 1, 0.0, mean)
        mean = torch.where(pool.single, v, mean)
    else:
        mean = torch.where(count > 0, total / count.clamp(min=1.0), 0.0)
    return torch.where(inside, mean, 0.0)


def _pool_std(v: Tensor, w: Tensor, mean: Tensor, pool: _Pool, unbiased: bool) -> Tensor:
    sq = pool.sums(((v - mean) * w).square())
    count = pool.sums(w)
    if unbiased:
        std = torch.where(count <= 1, 1.0, (sq / (count - 1).clamp(min=1.0)).sqrt())
        std = torch.where(pool.single, 1.0, std)
    else:
        std = torch.where(count == 0, 1.0, (sq / count.clamp(min=1.0)).sqrt())
    return torch.where(pool.index >= 0, std, 1.0)


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
    per_completion: bool = False,
) -> Tensor:
    """Normalise `x` as the module docstring describes; returns float32, 0 where masked.

    `x` is per-sequence `[B]` (rewards), per-token `[B, T]` (padded) or per-token `[N]` with
    `cu_seqlens` (packed). `mask` has `x`'s shape (default: all valid). `process_group`, when
    given, all-reduces the batch-level sums across data-parallel ranks (it is the only
    collective in the algorithm core; every rank must call, whatever its mask).
    `per_completion` makes each completion of a per-token input one element (the mean of its
    valid tokens) instead of each token.
    """
    spec = NormSpec(
        mean_level, mean_leave1out, std_level, std_unbiased, eps, group_size or 1, per_completion
    )
    _check_norm(spec)
    if mask is None:
        mask = torch.ones_like(x, dtype=torch.bool)
    if mask.shape != x.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but x has {tuple(x.shape)}")
    valid = mask.to(torch.bool)
    f64 = torch.float64
    xd = torch.where(valid, x.detach().to(f64), 0.0)

    per_sequence = x.ndim == 1 and cu_seqlens is None
    if per_sequence:
        n_seqs = x.shape[0]
        row_of = torch.arange(n_seqs, device=x.device)
        elem_x, elem_w = xd, valid.to(f64)
    else:
        layout = layout_of(x, cu_seqlens)
        n_seqs = layout.n_seqs
        if per_completion:
            count = seq_sum(valid, layout, dtype=f64)
            elem_x = seq_sum(xd, layout) / count.clamp(min=1.0)
            elem_w = (count > 0).to(f64)
            row_of = torch.arange(n_seqs, device=x.device)
        else:
            row_of = seq_broadcast(torch.arange(n_seqs, device=x.device), layout).reshape(-1)
            elem_x, elem_w = xd.reshape(-1), valid.to(f64).reshape(-1)

    pools: dict[Level, _Pool] = {}
    no_single = torch.zeros_like(elem_w, dtype=torch.bool)
    if "batch" in (mean_level, std_level):
        pools["batch"] = _Pool(torch.zeros_like(row_of), 1, no_single, process_group)
    if "group" in (mean_level, std_level):
        g = group_index_from_ids(group_ids, n_seqs, group_size, device=x.device)
        n_groups = int(g.max()) + 1 if n_seqs and bool((g >= 0).any()) else 0
        inside = g >= 0
        rows = torch.zeros(max(n_groups, 1), dtype=torch.int64, device=x.device)
        rows = rows.index_add(0, g.clamp(min=0), inside.to(torch.int64))
        single = inside & (rows[g.clamp(min=0)] == 1)
        pools["group"] = _Pool(g[row_of], n_groups, single[row_of])

    if mean_level is None:
        mean = torch.zeros_like(elem_x)
    else:
        mean = _pool_mean(elem_x, elem_w, pools[mean_level], mean_leave1out)
    if std_level is None:
        std, eps = torch.ones_like(elem_x), 0.0
    else:
        std = _pool_std(elem_x, elem_w, mean, pools[std_level], std_unbiased)

    if per_sequence:
        mean_e, std_e = mean, std
    elif per_completion:
        mean_e, std_e = seq_broadcast(mean, layout), seq_broadcast(std, layout)
    else:
        mean_e, std_e = mean.reshape(x.shape), std.reshape(x.shape)
    out = torch.where(valid, (xd - mean_e) / (std_e + eps), 0.0).to(torch.float32)
    if not bool(valid.any()):
        return x.to(torch.float32)
    return out


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
        per_completion=bool(getattr(norm, "per_completion", False)),
    )


__all__ = [
    "NormLike",
    "NormSpec",
    "check_per_seq",
    "group_index_from_ids",
    "normalize",
    "normalize_with",
]
