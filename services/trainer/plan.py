"""The step's work plan: which rows go to which minibatch, rank and micro-batch.

`plan[m][r]` lists rank r's micro-batches of minibatch m (each a list of batch rows).
Every rank holds the whole batch and computes the same plan from the sequence lengths, so
no communication is needed to agree on it, and every rank knows the minibatch-wide loss
denominators. All ranks get the same number of micro-batches per minibatch (empty ones
where a rank has fewer sequences): each forward/backward is an FSDP collective.

The forward-only passes (π_prox, reference, values) walk the same plan as training, so a
sequence meets exactly the same padding and batch-mates in both: with one minibatch and
`recompute`, π_θ equals π_prox bit for bit and the importance weight is exactly 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.common.config import MicroBatchSpec
from services.trainer.microbatch import balanced_partition, pad_bins

Plan = list[list[list[list[int]]]]


def _units(n_rows: int, granularity: int) -> list[list[int]]:
    """Consecutive rows kept together (`mb_spec.granularity`, e.g. one prompt group)."""
    return [list(range(i, min(i + granularity, n_rows))) for i in range(0, n_rows, granularity)]


def _split(
    rows: Sequence[int],
    lens: Sequence[int],
    granularity: int,
    **kwargs: int | None,
) -> list[list[int]]:
    units = [[rows[i] for i in u] for u in _units(len(rows), granularity)]
    unit_lens = [sum(lens[r] for r in u) for u in units]
    bins = balanced_partition(unit_lens, **kwargs)  # type: ignore[arg-type]
    return [sorted(r for ui in b for r in units[ui]) for b in bins]


def make_plan(
    lens: Sequence[int],
    *,
    n_minibatches: int,
    world_size: int,
    mb_spec: MicroBatchSpec,
) -> Plan:
    """Minibatches (balanced by tokens), each shared over ranks, each share cut into
    micro-batches under `mb_spec.max_tokens_per_mb` (at least `mb_spec.n_mbs`)."""
    if n_minibatches < 1:
        raise ValueError(f"ppo_n_minibatches must be >= 1, got {n_minibatches}")
    g = max(1, mb_spec.granularity)
    everything = list(range(len(lens)))
    minis = _split(everything, lens, g, exact_bins=n_minibatches)
    plan: Plan = []
    for mini in minis:
        shares = _split(mini, lens, g, exact_bins=world_size) if mini else [[]] * world_size
        per_rank = [
            _split(
                share, lens, g, min_bins=mb_spec.n_mbs or 1, max_tokens=mb_spec.max_tokens_per_mb
            )
            if share
            else []
            for share in shares
        ]
        k = max(1, max(len(p) for p in per_rank))
        div = max(1, mb_spec.n_mbs_divisor)
        k = math.ceil(k / div) * div
        plan.append([pad_bins(p, k) for p in per_rank])
    return plan


def rank_microbatches(plan: Plan, rank: int) -> list[tuple[int, list[int]]]:
    """(minibatch index, rows) of every micro-batch of `rank`, in plan order."""
    return [(m, mb) for m, per_rank in enumerate(plan) for mb in per_rank[rank]]
