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

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from services.common.config import NormConfig

from .layout import check_per_seq, layout_of, seq_broadcast, seq_sum

Level = Literal["batch", "group"] | None
_LEVELS = ("batch", "group", None)


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


def _check_levels(mean_level: Level, std_level: Level, mean_leave1out: bool, eps: float) -> None:
    """The keyword arguments of a direct `normalize` call (a `NormConfig` was checked at
    load)."""
    for field, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in _LEVELS:
            raise ValueError(f"{field} must be 'batch', 'group' or null, got {level!r}")
    if mean_leave1out and mean_level is None:
        raise ValueError("mean_leave1out=true needs a mean_level ('batch' or 'group')")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")


@dataclass(frozen=True)
class _Pool:
    """Which pool of elements each element's statistics come from.

    Elements live in the input's layout; `row_sum` reduces them to one sum per sequence
    and `to_elem` broadcasts a per-sequence value back, so pool statistics are formed per
    sequence (`[B]`) and only the final formula runs per element. `index[b]` is sequence
    b's pool (0..n-1; the batch is pool 0) or -1 for none; `single[b]` marks sequences
    alone in their pool; `process_group` all-reduces the pool sums (batch level)."""

    index: Tensor
    n: int
    single: Tensor
    row_sum: Callable[[Tensor], Tensor]
    to_elem: Callable[[Tensor], Tensor]
    process_group: Any = None

    @property
    def inside(self) -> Tensor:
        return self.index >= 0

    def sums(self, values: Tensor) -> Tensor:
        """Per-sequence sum of `values` over the sequence's pool (0 outside any pool)."""
        rows = self.row_sum(values)
        if self.n == 1 and bool(self.inside.all()):
            per_pool = rows.sum().reshape(1)
        else:
            per_pool = torch.zeros(max(self.n, 1), dtype=rows.dtype, device=rows.device)
            per_pool = per_pool.index_add(0, self.index.clamp(min=0), rows * self.inside)
        per_pool = _all_reduce(per_pool, self.process_group)
        return per_pool[self.index.clamp(min=0)] * self.inside


def _identity(t: Tensor) -> Tensor:
    return t


def _pool_mean(v: Tensor, w: Tensor, pool: _Pool, leave1out: bool) -> Tensor:
    """Per-element mean (see the module docstring); `v` is 0 wherever `w` is."""
    total, count = pool.sums(v), pool.sums(w)  # [B]
    if not leave1out:
        mean = torch.where(count > 0, total / count.clamp(min=1.0), 0.0)
        return pool.to_elem(mean)
    plain = torch.where(pool.inside & (count > 1), total / count.clamp(min=1.0), 0.0)
    loo_ok = pool.inside & (count > 1) & ~pool.single
    total_e, count_e = pool.to_elem(total), pool.to_elem(count)
    loo = (total_e - v) / (count_e - w).clamp(min=1.0)
    mean = torch.where(pool.to_elem(loo_ok) & (w > 0), loo, pool.to_elem(plain))
    return torch.where(pool.to_elem(pool.single), v, mean)


def _pool_std(v: Tensor, w: Tensor, mean: Tensor, pool: _Pool, unbiased: bool) -> Tensor:
    """Per-sequence std around the per-element `mean` (see the module docstring)."""
    sq = pool.sums(((v - mean) * w).square())
    count = pool.sums(w)
    if unbiased:
        std = torch.where(count <= 1, 1.0, (sq / (count - 1).clamp(min=1.0)).sqrt())
        std = torch.where(pool.single, 1.0, std)
    else:
        std = torch.where(count == 0, 1.0, (sq / count.clamp(min=1.0)).sqrt())
    return torch.where(pool.inside, std, 1.0)


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

    Copies: the statistics are taken in float64 (a copy of the valid values, needed for
    their accuracy on `[64, 1024]` batches) and the result is a new float32 tensor, except
    when the mask is empty: then `x` itself comes back when it is float32 already (`.to`
    does not copy). No defensive copy is made there because nothing in the algorithm core
    writes into a tensor in place (every step returns new tensors), so sharing storage with
    the input cannot change it; a caller that means to write into the result in place
    clones it first.
    """
    _check_levels(mean_level, std_level, mean_leave1out, eps)
    if mask is None:
        mask = torch.ones_like(x, dtype=torch.bool)
    if mask.shape != x.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but x has {tuple(x.shape)}")
    valid = mask.to(torch.bool)
    f64 = torch.float64
    xd = torch.where(valid, x.detach().to(f64), 0.0)

    per_sequence = x.ndim == 1 and cu_seqlens is None
    row_sum: Callable[[Tensor], Tensor]
    to_elem: Callable[[Tensor], Tensor]
    if per_sequence:
        n_seqs = x.shape[0]
        elem_x, elem_w = xd, valid.to(f64)
        row_sum = to_elem = _identity
    else:
        layout = layout_of(x, cu_seqlens)
        n_seqs = layout.n_seqs
        if per_completion:
            count = seq_sum(valid, layout, dtype=f64)
            elem_x = seq_sum(xd, layout) / count.clamp(min=1.0)
            elem_w = (count > 0).to(f64)
            row_sum = to_elem = _identity
        else:
            elem_x, elem_w = xd, valid.to(f64)

            def row_sum(t: Tensor) -> Tensor:
                return seq_sum(t, layout)

            def to_elem(t: Tensor) -> Tensor:
                return seq_broadcast(t, layout)

    pools: dict[Level, _Pool] = {}
    if "batch" in (mean_level, std_level):
        zeros = torch.zeros(n_seqs, dtype=torch.int64, device=x.device)
        pools["batch"] = _Pool(
            zeros, 1, zeros.to(torch.bool), row_sum, to_elem, process_group=process_group
        )
    if "group" in (mean_level, std_level):
        g = group_index_from_ids(group_ids, n_seqs, group_size, device=x.device)
        inside = g >= 0
        n_groups = int(g.max()) + 1 if bool(inside.any()) else 0
        rows = torch.zeros(max(n_groups, 1), dtype=torch.int64, device=x.device)
        rows = rows.index_add(0, g.clamp(min=0), inside.to(torch.int64))
        single = inside & (rows[g.clamp(min=0)] == 1)
        pools["group"] = _Pool(g, n_groups, single, row_sum, to_elem)

    if mean_level is None:
        mean = torch.zeros_like(elem_x)
    else:
        mean = _pool_mean(elem_x, elem_w, pools[mean_level], mean_leave1out)
    scale: Tensor | None = None
    if std_level is not None:
        pool = pools[std_level]
        std = _pool_std(elem_x, elem_w, mean, pool, std_unbiased)
        scale = pool.to_elem(std + eps)
    if per_completion and not per_sequence:
        # statistics of completion means, applied to every token of the completion
        mean = seq_broadcast(mean, layout)
        scale = None if scale is None else seq_broadcast(scale, layout)
    out = xd - mean
    if scale is not None:
        out = out / scale
    out = torch.where(valid, out, 0.0).to(torch.float32)
    if not bool(valid.any()):
        return x.to(torch.float32)
    return out


def normalize_with(
    x: Tensor,
    norm: NormConfig | None,
    mask: Tensor | None = None,
    *,
    group_ids: Sequence[Hashable] | Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    process_group: Any = None,
) -> Tensor:
    """`normalize` driven by a `NormConfig` (`actor.reward_norm` / `actor.adv_norm`,
    validated at load); `None` returns `x` (masked) as is: with no mask, `x` itself when it
    is float32 already. Not copied, for the reason `normalize` gives: the algorithms never
    write into a tensor in place, and `norm: null` is the common case of the advantages."""
    if norm is None:
        if mask is None:
            return x.to(torch.float32)
        return torch.where(mask.to(torch.bool), x, 0.0).to(torch.float32)
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
        per_completion=norm.per_completion,
    )


__all__ = [
    "check_per_seq",
    "group_index_from_ids",
    "normalize",
    "normalize_with",
]
