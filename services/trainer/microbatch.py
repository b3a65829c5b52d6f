"""Split sequences into balanced bins: minibatches, per-rank shares and micro-batches.

One function, `balanced_partition`, serves three splits of the step:
1. the batch into `ppo_n_minibatches` minibatches (exactly that many bins, no budget);
2. a minibatch across data-parallel ranks (exactly world_size bins, no budget);
3. a rank's share into micro-batches under `mb_spec.max_tokens_per_mb`, at least
   `mb_spec.n_mbs` of them (the `dynamic_bs` case: as few micro-batches as the budget
   allows, but never fewer than asked).

The placement is first-fit-decreasing made to balance: sequences sorted longest first,
each into the least loaded bin that still has room under the budget. When one does not
fit anywhere, the bin count grows by one and placement starts again. Ties break on the
original index so every rank computes the same split from the same lengths (no
communication needed to agree on it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def balanced_partition(
    lengths: Sequence[int],
    *,
    min_bins: int = 1,
    max_tokens: int | None = None,
    exact_bins: int | None = None,
) -> list[list[int]]:
    """Indices of `lengths` grouped into bins; each bin's indices ascending.

    `exact_bins`: produce exactly that many bins (some empty when there are fewer items),
    ignoring `max_tokens`. Otherwise: at least `min_bins` bins (capped by the item count),
    each holding at most `max_tokens` tokens (sum of lengths).
    Raises ValueError when one sequence alone exceeds `max_tokens`.
    """
    n = len(lengths)
    if exact_bins is not None:
        if exact_bins < 1:
            raise ValueError(f"exact_bins must be >= 1, got {exact_bins}")
        return _place(lengths, exact_bins, None) or [[] for _ in range(exact_bins)]
    if min_bins < 1:
        raise ValueError(f"mb_spec.n_mbs must be >= 1, got {min_bins}")
    if n == 0:
        return []
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"mb_spec.max_tokens_per_mb must be >= 1, got {max_tokens}")
        longest = max(lengths)
        if longest > max_tokens:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds mb_spec.max_tokens_per_mb={max_tokens}; "
                "raise max_tokens_per_mb to at least the longest prompt + completion"
            )
        start = max(min_bins, math.ceil(sum(lengths) / max_tokens))
    else:
        start = min_bins
    k = min(start, n)
    while True:
        bins = _place(lengths, k, max_tokens)
        if bins is not None:
            return bins
        k += 1  # terminates: with k == n every item has its own bin and fits


def _place(lengths: Sequence[int], k: int, cap: int | None) -> list[list[int]] | None:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * k
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        best = -1
        for b in range(k):
            if cap is not None and loads[b] + lengths[i] > cap:
                continue
            if best < 0 or loads[b] < loads[best]:
                best = b
        if best < 0:
            return None
        loads[best] += lengths[i]
        bins[best].append(i)
    return [sorted(b) for b in bins]


def pad_bins(bins: list[list[int]], count: int) -> list[list[int]]:
    """Append empty bins up to `count`: every FSDP rank must run the same number of
    forward/backward passes (each one all-gathers parameters), so a rank with fewer
    micro-batches runs empty ones."""
    if len(bins) > count:
        raise ValueError(f"{len(bins)} bins cannot be padded down to {count}")
    return bins + [[] for _ in range(count - len(bins))]
