"""Reward/advantage normalisation against AReaL 2.0's `Normalization`
(areal/utils/data.py: `Normalization.__call__`, `_compute_mean`, `_compute_std`): levels,
leave-one-out, token statistics, edge cases, unequal groups, all-reduce."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from services.trainer.algorithms.normalization import (
    group_index_from_ids,
    normalize,
    normalize_with,
)

from . import _reference as ref
from ._gloo_norm_worker import batch as gloo_batch
from ._views import norm

WORKER = Path(__file__).with_name("_gloo_norm_worker.py")
EPS = 1e-5


def test_grpo_group_normalisation_hand_computed() -> None:
    # AReaL `Normalization` with mean_level=std_level=group, group sizes [3, 2].
    # group a = [1, 0, 0], group b = [1, 1]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    ids = ["a", "a", "a", "b", "b"]
    out = normalize(rewards, mean_level="group", std_level="group", group_ids=ids, eps=EPS)
    # a: mean 1/3, unbiased std = sqrt(((2/3)^2 + 2*(1/3)^2)/2) = sqrt(1/3) = 0.5773503
    #    (1 - 1/3)/0.5773503 = 1.1547005 ; (0 - 1/3)/0.5773503 = -0.5773503
    # b: mean 1, std 0 -> 0/(0 + eps) = 0
    expected = torch.tensor([1.1547005, -0.5773503, -0.5773503, 0.0, 0.0])
    assert_close(out, expected, rtol=0, atol=1e-4)


def test_rloo_leave_one_out_group_of_one_and_batch_of_one() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 7.0])
    ids = [0, 0, 0, 1, 1, 2]  # group 2 has a single sample
    out = normalize(rewards, mean_level="group", std_level=None, mean_leave1out=True, group_ids=ids)
    # AReaL 2.0 `Normalization.__call__`: a: 1 - (0+0)/2 = 1 ; 0 - (1+0)/2 = -0.5 (twice);
    # b: 1 - 1 = 0; a group of one sequence is its own baseline: 7 - 7 = 0.
    assert_close(out, torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]), rtol=0, atol=1e-7)
    # Batch level with one element: `_compute_mean` returns 0 when the count is <= 1, so
    # with std_level null (std 1, eps 0) the value passes through: 3 - 0 = 3.
    single = normalize(torch.tensor([3.0]), mean_level="batch", std_level=None, mean_leave1out=True)
    assert single.tolist() == [3.0]


def test_leave_one_out_std_is_around_the_leave_one_out_mean() -> None:
    # AReaL `_compute_std(x, mask, mean)` takes the per-element mean that was subtracted.
    rewards = torch.tensor([1.0, 0.0, 0.0])
    out = normalize(
        rewards, mean_level="group", std_level="group", mean_leave1out=True, group_ids=[0, 0, 0]
    )
    # LOO means: (0+0)/2 = 0, (1+0)/2 = 0.5, 0.5 -> centred [1, -0.5, -0.5]
    # std = sqrt((1 + 0.25 + 0.25)/(3-1)) = sqrt(0.75) = 0.8660254
    # out = [1/0.8660354, -0.5/0.8660354, ...] = [1.1546872, -0.5773436, -0.5773436]
    assert_close(out, torch.tensor([1.1546872, -0.5773436, -0.5773436]), rtol=0, atol=1e-6)


def test_batch_normalisation_hand_computed() -> None:
    x = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    # mean 0.6; unbiased var = (3*0.16 + 2*0.36)/4 = 0.3 -> std 0.5477226
    out = normalize(x, mean_level="batch", std_level="batch", eps=0.0 + 1e-12)
    expected = (x - 0.6) / 0.5477226
    assert_close(out, expected, rtol=0, atol=1e-5)
    # biased std: var = 1.2/5 = 0.24 -> 0.4898979
    out = normalize(x, mean_level="batch", std_level="batch", std_unbiased=False, eps=1e-12)
    assert_close(out, (x - 0.6) / 0.4898979, rtol=0, atol=1e-5)


def test_mean_level_null_std_is_rms_around_zero() -> None:
    # AReaL: mean = zeros, so `_compute_std` is sqrt(sum x^2 / (n-1)).
    x = torch.tensor([3.0, 4.0])
    out = normalize(x, mean_level=None, std_level="batch", eps=EPS)
    # sum x^2 = 9 + 16 = 25, / (2-1) -> std 5; out = [3, 4] / 5.00001
    assert_close(out, torch.tensor([3.0, 4.0]) / 5.00001, rtol=0, atol=1e-7)


def test_group_statistics_weigh_tokens_by_default() -> None:
    # One group: a long completion of advantage 1 (3 tokens), a short one of 0 (1 token).
    adv = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = normalize(adv, mask, mean_level="group", std_level=None, group_ids=[0, 0])
    # AReaL `_compute_mean` over the group's valid tokens: (1+1+1+0)/4 = 0.75
    expected = torch.tensor([[0.25, 0.25, 0.25], [-0.75, 0.0, 0.0]])
    assert_close(out, expected, rtol=0, atol=1e-7)
    # Flywheel's option: each completion is one element (its token mean): (1 + 0)/2 = 0.5
    per_c = normalize(
        adv, mask, mean_level="group", std_level=None, group_ids=[0, 0], per_completion=True
    )
    assert_close(per_c, torch.tensor([[0.5, 0.5, 0.5], [-0.5, 0.0, 0.0]]), rtol=0, atol=1e-7)
    # ... and its std is over completion means around their own mean:
    # means [1, 0], baseline 0.5, unbiased std sqrt((0.25+0.25)/1) = 0.7071068
    per_c = normalize_with(
        adv,
        norm("group", False, "group", std_unbiased=True, eps=EPS, per_completion=True),
        mask,
        group_ids=[0, 0],
    )
    assert_close(per_c[0, 0], torch.tensor(0.5 / (0.7071068 + EPS)), rtol=0, atol=1e-6)


def test_token_leave_one_out_leaves_out_one_token() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    out = normalize(x, mask, mean_level="batch", std_level=None, mean_leave1out=True)
    # AReaL `_compute_mean(leave_one_out=True)` with a mask: S = 6, n = 3 valid tokens;
    # token means (6-1)/2 = 2.5, (6-2)/2 = 2, (6-3)/2 = 1.5 -> [1-2.5, 2-2, 3-1.5] and 0
    assert_close(out, torch.tensor([[-1.5, 0.0], [1.5, 0.0]]), rtol=0, atol=1e-7)


def test_litppo_group_mean_batch_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    out = normalize(rewards, mean_level="group", std_level="batch", group_ids=[0, 0, 1, 1])
    # AReaL: group means [0.5, 0.5, 1, 1] -> centred [0.5, -0.5, 0, 0]; the batch std is
    # around those same means: sqrt((0.25 + 0.25)/(4-1)) = 0.4082483
    # out = 0.5/(0.4082483 + 1e-5) = 1.2247149
    assert_close(out, torch.tensor([1.2247149, -1.2247149, 0.0, 0.0]), rtol=0, atol=1e-6)


def test_singleton_group_has_unit_std_not_eps() -> None:
    # Today's bug: a singleton group had std 0 and produced (x - mean)/eps ~ 1e5.
    x = torch.tensor([[1.0, 3.0], [0.0, 4.0]])
    out = normalize(x, mean_level="group", std_level="group", group_ids=[0, 1])
    # AReaL `Normalization.__call__`: a group of one sequence with std_unbiased has std 1.
    # row 0: token mean 2 -> [-1, 1]/(1 + 1e-5); row 1: mean 2 -> [-2, 2]/(1 + 1e-5)
    expected = torch.tensor([[-1.0, 1.0], [-2.0, 2.0]]) / (1 + EPS)
    assert_close(out, expected, rtol=0, atol=1e-7)
    # Unbiased std of one valid element is 1 (`_compute_std`: factor <= 1 -> ones).
    one = normalize(torch.tensor([3.0]), mean_level=None, std_level="batch")
    assert_close(one, torch.tensor([3.0 / (1 + EPS)]), rtol=0, atol=1e-7)


def test_std_level_null_means_std_one_and_eps_zero() -> None:
    x = torch.tensor([1.0, 2.0, 6.0])
    # AReaL: std = ones, eps = 0 -> exactly x - mean = [1-3, 2-3, 6-3]
    out = normalize(x, mean_level="batch", std_level=None, eps=0.5)
    assert out.tolist() == [-2.0, -1.0, 3.0]


def test_rows_in_no_full_group_get_mean_zero() -> None:
    # Fixed-stride fallback (no group ids), group_size 2, three rows: AReaL slices
    # bs // group_size = 1 group; row 2 keeps mean 0.
    x = torch.tensor([1.0, 3.0, 5.0])
    out = normalize(x, mean_level="group", std_level=None, group_size=2)
    assert out.tolist() == [-1.0, 1.0, 5.0]
    out = normalize(x, mean_level="group", std_level="group", group_size=2)
    # group 0: mean 2, std sqrt(2) = 1.4142136 -> [-1, 1]/1.4142236; row 2: std 1 (AReaL
    # would divide by eps here, see the differences table) -> 5/(1 + 1e-5)
    expected = torch.tensor([-1 / 1.4142236, 1 / 1.4142236, 5 / (1 + EPS)])
    assert_close(out, expected, rtol=0, atol=1e-6)


def test_mask_summing_to_zero_returns_input_unchanged() -> None:
    x = torch.tensor([[1.5, -2.0], [7.0, 0.25]], dtype=torch.float64)
    out = normalize(x, torch.zeros(2, 2, dtype=torch.bool), mean_level="group", group_ids=[0, 0])
    assert out.dtype == torch.float32
    assert out.tolist() == x.float().tolist()


def _check_against_loop(
    x: torch.Tensor,
    mask: torch.Tensor,
    groups: list[int],
    mean_level: str | None,
    std_level: str | None,
    leave1out: bool,
    unbiased: bool,
) -> None:
    """`normalize` equals the plain loop written from AReaL's formula (`_reference`)."""
    out = normalize(
        x,
        mask,
        mean_level=mean_level,  # type: ignore[arg-type]
        std_level=std_level,  # type: ignore[arg-type]
        mean_leave1out=leave1out,
        std_unbiased=unbiased,
        group_ids=groups,
        eps=EPS,
    )
    expected = ref.normalize_tokens(
        x.tolist(),
        mask.tolist(),
        group_index_from_ids(groups, len(groups)).tolist(),
        mean_level=mean_level,
        std_level=std_level,
        leave1out=leave1out,
        unbiased=unbiased,
        eps=EPS,
    )
    # float32 inputs, float64 statistics on both sides; values up to ~|x|/eps-free
    assert_close(out, torch.tensor(expected, dtype=torch.float32), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 4), (6, 9), (12, 31)])
@pytest.mark.parametrize(
    "mean_level,std_level,leave1out",
    [
        ("batch", "batch", False),
        ("batch", "batch", True),
        ("group", "group", False),
        ("group", "group", True),
        ("group", None, True),
        ("group", "batch", False),
        ("batch", None, True),
        (None, "group", False),
        (None, "batch", False),
    ],
)
def test_token_normalisation_matches_plain_loop(
    shape: tuple[int, int],
    mean_level: str | None,
    std_level: str | None,
    leave1out: bool,
    gen: torch.Generator,
) -> None:
    b, t = shape
    x = torch.randn(b, t, generator=gen)
    mask = torch.rand(b, t, generator=gen) < 0.7
    # unequal groups, in an order that is not contiguous
    groups = torch.randint(0, max(1, b // 3), (b,), generator=gen)
    _check_against_loop(x, mask, groups.tolist(), mean_level, std_level, leave1out, True)


# -- properties (hypothesis) -----------------------------------------------------------------

_LEVEL = st.sampled_from(["batch", "group", None])


@st.composite
def _batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 5))
    vals = draw(
        st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=b * t, max_size=b * t)
    )
    bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    groups = draw(st.lists(st.integers(0, 2), min_size=b, max_size=b))
    x = torch.tensor(vals, dtype=torch.float32).reshape(b, t)
    mask = torch.tensor(bits).reshape(b, t)
    return x, mask, groups


@settings(max_examples=60, deadline=None)
@given(batch=_batches(), mean_level=_LEVEL, std_level=_LEVEL, loo=st.booleans(), unb=st.booleans())
def test_property_equals_arealformula_loop(
    batch: tuple[torch.Tensor, torch.Tensor, list[int]],
    mean_level: str | None,
    std_level: str | None,
    loo: bool,
    unb: bool,
) -> None:
    x, mask, groups = batch
    loo = loo and mean_level is not None
    _check_against_loop(x, mask, groups, mean_level, std_level, loo, unb)


@settings(max_examples=40, deadline=None)
@given(batch=_batches(), mean_level=_LEVEL, std_level=_LEVEL)
def test_property_all_masked_returns_input(
    batch: tuple[torch.Tensor, torch.Tensor, list[int]],
    mean_level: str | None,
    std_level: str | None,
) -> None:
    x, _, groups = batch
    none = torch.zeros_like(x, dtype=torch.bool)
    out = normalize(x, none, mean_level=mean_level, std_level=std_level, group_ids=groups)  # type: ignore[arg-type]
    assert torch.equal(out, x)


@settings(max_examples=40, deadline=None)
@given(batch=_batches())
def test_property_singleton_groups_are_bounded(
    batch: tuple[torch.Tensor, torch.Tensor, list[int]],
) -> None:
    # Every sequence its own group: std 1 (unbiased), so |out| <= |x - mean| <= 10, never
    # a division by eps; under leave-one-out the output is 0.
    x, mask, _ = batch
    ids = list(range(x.shape[0]))
    out = normalize(x, mask, mean_level="group", std_level="group", group_ids=ids)
    assert bool((out.abs() <= 10.0 + 1e-4).all())
    loo = normalize(
        x, mask, mean_level="group", std_level="group", mean_leave1out=True, group_ids=ids
    )
    if bool(mask.any()):
        assert bool((loo == 0).all())


@settings(max_examples=40, deadline=None)
@given(batch=_batches(), mean_level=_LEVEL)
def test_property_std_null_is_exact_centring(
    batch: tuple[torch.Tensor, torch.Tensor, list[int]], mean_level: str | None
) -> None:
    # std_level null: std 1 and eps 0, whatever eps says.
    x, mask, groups = batch
    a = normalize(x, mask, mean_level=mean_level, std_level=None, eps=0.3, group_ids=groups)  # type: ignore[arg-type]
    b = normalize(x, mask, mean_level=mean_level, std_level=None, eps=0.0, group_ids=groups)  # type: ignore[arg-type]
    assert torch.equal(a, b)
    if mean_level is None and bool(mask.any()):
        assert torch.equal(a, torch.where(mask, x, 0.0))


@settings(max_examples=40, deadline=None)
@given(
    vals=st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=1, max_size=9),
    size=st.integers(2, 4),
)
def test_property_rows_in_no_full_group(vals: list[float], size: int) -> None:
    # Fixed-stride groups: rows after the last full group have mean 0 and std 1.
    x = torch.tensor(vals)
    out = normalize(x, mean_level="group", std_level="group", group_size=size)
    tail = (len(vals) // size) * size
    assert_close(out[tail:], x[tail:] / (1 + EPS), rtol=0, atol=1e-6)


def test_masked_positions_do_not_leak(gen: torch.Generator) -> None:
    x = torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) < 0.6
    dirty = torch.where(mask, x, torch.tensor(float("nan")))
    for loo in (False, True):
        a = normalize(
            x,
            mask,
            mean_level="group",
            std_level="batch",
            mean_leave1out=loo,
            group_ids=[0, 0, 1, 1],
        )
        b = normalize(
            dirty,
            mask,
            mean_level="group",
            std_level="batch",
            mean_leave1out=loo,
            group_ids=[0, 0, 1, 1],
        )
        assert_close(a, b, rtol=0, atol=0)
        assert bool((a[~mask] == 0).all())


def test_packed_equals_padded(gen: torch.Generator) -> None:
    lengths = torch.tensor([3, 5, 1, 4])
    x = torch.randn(4, 5, generator=gen)
    valid = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)
    mask = valid & (torch.rand(4, 5, generator=gen) < 0.8)
    cu = torch.tensor([0, 3, 8, 9, 13])
    packed_x, packed_m = x[valid], mask[valid]
    for spec in (
        norm("group", True, None),
        norm("group", False, "group"),
        norm("batch", False, "batch"),
        norm("group", True, "group", per_completion=True),
    ):
        padded = normalize_with(x, spec, mask, group_ids=[0, 0, 1, 1])
        packed = normalize_with(packed_x, spec, packed_m, group_ids=[0, 0, 1, 1], cu_seqlens=cu)
        assert_close(packed, padded[valid], rtol=1e-6, atol=1e-6)


def test_group_index_fallback_and_errors() -> None:
    assert group_index_from_ids(None, 6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    # rows after the last full group belong to no group
    assert group_index_from_ids(None, 6, 4).tolist() == [0, 0, 0, 0, -1, -1]
    assert group_index_from_ids(["x", "y", "x"], 3).tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="3 entries for 2"):
        group_index_from_ids([1, 2, 3], 2)
    with pytest.raises(ValueError, match="mean_leave1out=true needs a mean_level"):
        normalize(torch.ones(3), mean_level=None, mean_leave1out=True)
    with pytest.raises(ValueError, match="mean_level"):  # refused at load
        norm(mean_level="prompt", mean_leave1out=False, std_level="batch")  # type: ignore[arg-type]


def test_norm_config_drives_normalize_with() -> None:
    from pydantic import ValidationError

    from services.common.config.normalization import NormConfig

    adv = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    # AReaL's default (token statistics): group mean (1+1+1+0)/4 = 0.75
    cfg = NormConfig(mean_level="group", std_level=None)
    out = normalize_with(adv, cfg, mask, group_ids=[0, 0])
    assert_close(out[1, 0], torch.tensor(-0.75), rtol=0, atol=1e-7)
    # per_completion: completion means [1, 0] -> baseline 0.5
    cfg = NormConfig(mean_level="group", std_level=None, per_completion=True)
    out = normalize_with(adv, cfg, mask, group_ids=[0, 0])
    assert_close(out[1, 0], torch.tensor(-0.5), rtol=0, atol=1e-7)
    with pytest.raises(ValidationError, match="leave-one-out needs a mean"):
        NormConfig(mean_level=None, mean_leave1out=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_batch_level_all_reduce_over_real_gloo_group_equals_single_process() -> None:
    # Two real gloo ranks (separate processes) each hold half of the batch; with the process
    # group the result must equal normalising the whole batch in one process.
    x, mask = gloo_batch()  # the same seeded batch the ranks build
    whole = normalize(x, mask, mean_level="batch", std_level="batch")
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(torch.tensor(json.loads(out.strip().splitlines()[-1])))
    assert_close(torch.cat(outs), whole, rtol=1e-6, atol=1e-6)
    # Without the all-reduce each half would use its own statistics (a real difference).
    local = normalize(x[:3], mask[:3], mean_level="batch", std_level="batch")
    assert not torch.allclose(local, whole[:3], atol=1e-3)


def test_results_share_the_inputs_storage_only_where_nothing_is_computed() -> None:
    # The documented copy rule: a computed result is a new tensor (the input is never
    # written), and the pass-throughs of a float32 input (empty mask; `norm: null` with no
    # mask) hand back the input itself instead of copying it.
    x = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    before = x.clone()
    out = normalize(x, mean_level="batch", std_level="batch")
    assert out.data_ptr() != x.data_ptr()
    assert torch.equal(x, before)
    assert normalize(x, torch.zeros(2, 2, dtype=torch.bool)) is x
    assert normalize_with(x, None) is x
    masked = normalize_with(x, None, torch.tensor([[True, False], [True, True]]))
    assert masked.data_ptr() != x.data_ptr() and masked[0, 1] == 0.0
