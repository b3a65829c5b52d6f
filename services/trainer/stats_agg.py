"""Combine statistics of many micro-batches on many ranks into one value per name.

Two kinds arrive from the algorithm core (`services.trainer.algorithms.stats`):

* scalars (0-d): means over the tokens of one call plus `n_valid_tokens`; the step's
  value is the token-weighted mean over every call on every rank. Counts add up;
  `*_min` / `*_max` reduce with MIN / MAX. A ratio over another count is weighted by that
  count (`masked_token_ratio` by `n_total_tokens`), so the step's value is the ratio of
  the step's sums.
* per-token tensors (AReaL's `importance_weight`, `clip_mask`, `behave_imp_weight`, ...):
  `add_loss_stats` takes a loss's stats with the table that names them
  (`ACTOR_TOKEN_STATS`, `CRITIC_TOKEN_STATS`) and keeps, per reported name, the sum and
  count over its mask and the min and max (`token_reductions`, the one place that reads
  the masks). The step reports `<name>/avg` = total sum / total count, `<name>/min`,
  `<name>/max` over every masked token of the step, as AReaL's stats tracker exports them.

All ranks reduce the same fixed vectors (every documented name, in sorted order) so the
collective has one shape even when a rank ran only empty micro-batches.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from services.trainer.algorithms.stats import STATS, TokenStat, scalar_stats, token_reductions

_NAMES = sorted(STATS)
_INDEX = {n: i for i, n in enumerate(_NAMES)}
_MIN = [n for n in _NAMES if n.endswith(("_min", "/min"))]
_MAX = [n for n in _NAMES if n.endswith(("_max", "/max"))]
_MIN_INDEX = {n: i for i, n in enumerate(_MIN)}
_MAX_INDEX = {n: i for i, n in enumerate(_MAX)}
# Counts add up instead of averaging.
_SUMS = {
    "n_valid_tokens",
    "n_total_tokens",
    "n_masked_tokens",
    "n_seqs",
    "correct_n_seqs",
    "incorrect_n_seqs",
}
# Scalars whose weight is another count of the same call rather than `n_valid_tokens`.
_WEIGHT_BY = {"masked_token_ratio": "n_total_tokens"}


class StatAccumulator:
    def __init__(self) -> None:
        n = len(_NAMES)
        self._wsum = torch.zeros(n, dtype=torch.float64)
        self._weight = torch.zeros(n, dtype=torch.float64)
        self._min = torch.full((len(_MIN),), math.inf, dtype=torch.float64)
        self._max = torch.full((len(_MAX),), -math.inf, dtype=torch.float64)

    def add(self, stats: dict[str, torch.Tensor | float], weight: float | None = None) -> None:
        """Add one call's scalar stats; `weight` defaults to its `n_valid_tokens`."""
        w = float(stats.get("n_valid_tokens", 1.0)) if weight is None else float(weight)
        for name, value in stats.items():
            if isinstance(value, torch.Tensor) and value.dim() != 0:
                continue  # per-token tensors go through add_loss_stats
            v = float(value)
            if name in _SUMS:
                self._wsum[_INDEX[name]] += v
                self._weight[_INDEX[name]] = 1.0
            elif name in _MIN_INDEX:
                if w > 0:
                    i = _MIN_INDEX[name]
                    self._min[i] = min(float(self._min[i]), v)
            elif name in _MAX_INDEX:
                if w > 0:
                    i = _MAX_INDEX[name]
                    self._max[i] = max(float(self._max[i]), v)
            elif name in _INDEX and math.isfinite(v):
                wn = w if name not in _WEIGHT_BY else float(stats.get(_WEIGHT_BY[name], w))
                if wn > 0:
                    self._wsum[_INDEX[name]] += v * wn
                    self._weight[_INDEX[name]] += wn

    def add_loss_stats(
        self,
        stats: dict[str, torch.Tensor],
        table: dict[str, TokenStat],
        extra: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Add a loss call's stats: its per-token statistics by `table`, its documented
        scalars (and `extra` scalars, e.g. the proximal method's) weighted by its
        `n_valid_tokens`."""
        self.add({**scalar_stats(stats), **(extra or {})})
        reds = token_reductions(stats, table)
        if not reds:
            return
        # one device-to-host copy for every statistic of the call
        rows = torch.stack(
            [
                torch.stack([r.total.double(), r.count.double(), r.min.double(), r.max.double()])
                for r in reds.values()
            ]
        ).tolist()
        for name, (total, count, lo, hi) in zip(reds, rows, strict=True):
            i = _INDEX[f"{name}/avg"]
            self._wsum[i] += total
            self._weight[i] += count
            if count > 0:
                j, k = _MIN_INDEX[f"{name}/min"], _MAX_INDEX[f"{name}/max"]
                self._min[j] = min(float(self._min[j]), lo)
                self._max[k] = max(float(self._max[k]), hi)

    def reduce(self) -> dict[str, float]:
        """All-reduce over ranks (collective) and return {name: value} for names seen."""
        wsum, weight = self._wsum.clone(), self._weight.clone()
        lo, hi = self._min.clone(), self._max.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            both = torch.cat([wsum, weight])
            dist.all_reduce(both)
            wsum, weight = both[: len(_NAMES)], both[len(_NAMES) :]
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        out: dict[str, float] = {}
        for name, i in _INDEX.items():
            if weight[i] > 0:
                out[name] = float(wsum[i]) if name in _SUMS else float(wsum[i] / weight[i])
        for i, name in enumerate(_MIN):
            if math.isfinite(float(lo[i])):
                out[name] = float(lo[i])
        for i, name in enumerate(_MAX):
            if math.isfinite(float(hi[i])):
                out[name] = float(hi[i])
        return out
