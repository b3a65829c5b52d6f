"""Combine statistics of many micro-batches on many ranks into one value per name.

The algorithm core returns means over the tokens of one call plus `n_valid_tokens`; the
step's value of a mean statistic is therefore the token-weighted mean over every call on
every rank. All ranks reduce the same fixed vector (every documented name, in sorted
order) so the collective has one shape even when a rank ran only empty micro-batches.
`*_min` / `*_max` statistics reduce with MIN / MAX instead.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from services.trainer.algorithms.stats import STATS

_NAMES = sorted(STATS)
_INDEX = {n: i for i, n in enumerate(_NAMES)}
_MIN = [n for n in _NAMES if n.endswith("_min")]
_MAX = [n for n in _NAMES if n.endswith("_max")]
# Counts add up instead of averaging.
_SUMS = {"n_valid_tokens", "n_seqs", "correct_n_seqs", "incorrect_n_seqs"}


class StatAccumulator:
    def __init__(self) -> None:
        n = len(_NAMES)
        self._wsum = torch.zeros(n, dtype=torch.float64)
        self._weight = torch.zeros(n, dtype=torch.float64)
        self._min = torch.full((len(_MIN),), math.inf, dtype=torch.float64)
        self._max = torch.full((len(_MAX),), -math.inf, dtype=torch.float64)

    def add(self, stats: dict[str, torch.Tensor | float], weight: float | None = None) -> None:
        """Add one call's stats; `weight` defaults to its `n_valid_tokens`."""
        w = float(stats.get("n_valid_tokens", 1.0)) if weight is None else float(weight)
        for name, value in stats.items():
            v = float(value)
            if name in _SUMS:
                self._wsum[_INDEX[name]] += v
                self._weight[_INDEX[name]] = 1.0
            elif name in _MIN:
                if w > 0:
                    i = _MIN.index(name)
                    self._min[i] = min(float(self._min[i]), v)
            elif name in _MAX:
                if w > 0:
                    i = _MAX.index(name)
                    self._max[i] = max(float(self._max[i]), v)
            elif name in _INDEX and w > 0 and math.isfinite(v):
                self._wsum[_INDEX[name]] += v * w
                self._weight[_INDEX[name]] += w

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
