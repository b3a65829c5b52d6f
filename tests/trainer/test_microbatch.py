"""Balanced partitions and the step plan: worked examples and invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import MicroBatchSpec
from services.trainer.microbatch import balanced_partition, pad_bins
from services.trainer.plan import make_plan, rank_microbatches


def test_exact_bins_balance_longest_first() -> None:
    # Sorted longest first: 9(i1) -> bin0, 7(i3) -> bin1, 5(i0) -> bin1 (load 7 < 9),
    # 3(i2) -> bin0 (load 9 < 12), 1(i4) -> bin1? loads: bin0 = 12, bin1 = 12 -> tie -> bin0.
    bins = balanced_partition([5, 9, 3, 7, 1], exact_bins=2)
    assert bins == [[1, 2, 4], [0, 3]]
    assert [sum([5, 9, 3, 7, 1][i] for i in b) for b in bins] == [13, 12]


def test_exact_bins_with_fewer_items_leaves_empty_bins() -> None:
    assert balanced_partition([4], exact_bins=3) == [[0], [], []]
    assert balanced_partition([], exact_bins=2) == [[], []]


def test_token_budget_sets_the_bin_count() -> None:
    # 6 + 6 + 4 + 4 = 20 tokens under a budget of 10: at least ceil(20/10) = 2 bins, and
    # 2 bins of 10 fit exactly (6+4 each).
    bins = balanced_partition([6, 4, 6, 4], max_tokens=10)
    assert len(bins) == 2
    assert sorted(sum([6, 4, 6, 4][i] for i in b) for b in bins) == [10, 10]


def test_budget_that_does_not_pack_grows_the_bin_count() -> None:
    # 7 + 7 + 7 = 21 under budget 11: ceil(21/11) = 2 bins cannot hold three 7s (7+7 > 11),
    # so a third bin is added.
    assert balanced_partition([7, 7, 7], max_tokens=11) == [[0], [1], [2]]


def test_min_bins_is_respected_but_capped_by_items() -> None:
    assert len(balanced_partition([1, 1, 1, 1], min_bins=3)) == 3
    assert len(balanced_partition([1, 1], min_bins=5)) == 2


def test_sequence_longer_than_the_budget_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_mb=8"):
        balanced_partition([3, 9], max_tokens=8)


def test_bad_counts_name_the_field() -> None:
    with pytest.raises(ValueError, match="n_mbs"):
        balanced_partition([1], min_bins=0)
    with pytest.raises(ValueError, match="exact_bins"):
        balanced_partition([1], exact_bins=0)


def test_pad_bins() -> None:
    assert pad_bins([[0], [1]], 4) == [[0], [1], [], []]
    with pytest.raises(ValueError):
        pad_bins([[0], [1]], 1)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    budget=st.integers(40, 120),
    n_mbs=st.integers(1, 4),
)
def test_every_index_once_and_every_bin_within_budget(lens, budget, n_mbs) -> None:
    bins = balanced_partition(lens, min_bins=n_mbs, max_tokens=budget)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lens)))
    assert all(sum(lens[i] for i in b) <= budget for b in bins)
    assert len(bins) >= min(n_mbs, len(lens))


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 30), min_size=1, max_size=24),
    n_mini=st.integers(1, 3),
    world=st.integers(1, 3),
)
def test_plan_covers_each_row_once_with_equal_microbatch_counts(lens, n_mini, world) -> None:
    spec = MicroBatchSpec(n_mbs=1, max_tokens_per_mb=64)
    plan = make_plan(lens, n_minibatches=n_mini, world_size=world, mb_spec=spec)
    assert len(plan) == n_mini
    rows = sorted(r for per_rank in plan for mbs in per_rank for mb in mbs for r in mb)
    assert rows == list(range(len(lens)))
    for per_rank in plan:
        assert len(per_rank) == world
        # Every rank runs the same number of forward/backward passes (FSDP collectives).
        assert len({len(mbs) for mbs in per_rank}) == 1
    counts = {len(rank_microbatches(plan, r)) for r in range(world)}
    assert len(counts) == 1


def test_plan_granularity_keeps_groups_together_and_divisor_rounds_up() -> None:
    # 8 rows = 2 groups of 4 (granularity 4); one minibatch, one rank, budget large:
    # n_mbs=1 gives 1 micro-batch, rounded up to a multiple of n_mbs_divisor=3.
    spec = MicroBatchSpec(n_mbs=2, granularity=4, n_mbs_divisor=3)
    plan = make_plan([3] * 8, n_minibatches=1, world_size=1, mb_spec=spec)
    mbs = plan[0][0]
    assert len(mbs) == 3
    assert sorted(map(tuple, (mb for mb in mbs if mb))) == [(0, 1, 2, 3), (4, 5, 6, 7)]
