"""Reward/advantage normalisation: levels, leave-one-out, unequal groups, all-reduce."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from services.trainer.algorithms.normalization import (
    NormSpec,
    group_index_from_ids,
    normalize,
    normalize_with,
)

from . import _reference as ref
from ._gloo_norm_worker import batch as gloo_batch

WORKER = Path(__file__).with_name("_gloo_norm_worker.py")


def test_grpo_group_normalisation_hand_computed() -> None:
    # group a = [1, 0, 0], group b = [1, 1]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    ids = ["a", "a", "a", "b", "b"]
    out = normalize(rewards, mean_level="group", std_level="group", group_ids=ids, eps=1e-5)
    # a: mean 1/3, unbiased std = sqrt(((2/3)^2 + 2*(1/3)^2)/2) = sqrt(1/3) = 0.5773503
    #    (1 - 1/3)/0.5773503 = 1.1547005 ; (0 - 1/3)/0.5773503 = -0.5773503
    # b: mean 1, std 0 -> 0/(0 + eps) = 0
    expected = torch.tensor([1.1547005, -0.5773503, -0.5773503, 0.0, 0.0])
    assert_close(out, expected, rtol=0, atol=1e-4)


def test_rloo_leave_one_out_and_group_of_one_gives_zero() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 7.0])
    ids = [0, 0, 0, 1, 1, 2]  # group 2 has a single sample
    out = normalize(rewards, mean_level="group", std_level=None, mean_leave1out=True, group_ids=ids)
    # a: 1 - (0+0)/2 = 1 ; 0 - (1+0)/2 = -0.5 (twice); b: 1 - 1 = 0; group of one: 0
    assert_close(out, torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]), rtol=0, atol=1e-7)
    single = normalize(torch.tensor([3.0]), mean_level="batch", std_level=None, mean_leave1out=True)
    assert single.tolist() == [0.0]


def test_batch_normalisation_hand_computed() -> None:
    x = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    # mean 0.6; unbiased var = (3*0.16 + 2*0.36)/4 = 0.3 -> std 0.5477226
    out = normalize(x, mean_level="batch", std_level="batch", eps=0.0 + 1e-12)
    expected = (x - 0.6) / 0.5477226
    assert_close(out, expected, rtol=0, atol=1e-5)
    # biased std: var = 1.2/5 = 0.24 -> 0.4898979
    out = normalize(x, mean_level="batch", std_level="batch", std_unbiased=False, eps=1e-12)
    assert_close(out, (x - 0.6) / 0.4898979, rtol=0, atol=1e-5)


def test_group_statistics_count_each_completion_once() -> None:
    # One group, a long completion of reward 1 (3 tokens) and a short one of reward 0 (1 token).
    adv = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = normalize(adv, mask, mean_level="group", std_level=None, group_ids=[0, 0])
    # per-completion baseline (1 + 0)/2 = 0.5 (a token-weighted one would be 0.75)
    expected = torch.tensor([[0.5, 0.5, 0.5], [-0.5, 0.0, 0.0]])
    assert_close(out, expected, rtol=0, atol=1e-7)


def test_litppo_group_mean_batch_std() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    out = normalize(rewards, mean_level="group", std_level="batch", group_ids=[0, 0, 1, 1])
    # group means 0.5 and 1 -> centred [0.5, -0.5, 0, 0]; batch std of x: mean 0.75,
    # unbiased var = (3*0.0625 + 0.5625)/3 = 0.25 -> std 0.5
    assert_close(out, torch.tensor([1.0, -1.0, 0.0, 0.0]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 4), (6, 9), (12, 31)])
@pytest.mark.parametrize(
    "mean_level,std_level,leave1out",
    [
        ("batch", "batch", False),
        ("group", "group", False),
        ("group", None, True),
        ("group", "batch", False),
        ("batch", None, True),
        (None, "group", False),
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
    out = normalize(
        x,
        mask,
        mean_level=mean_level,  # type: ignore[arg-type]
        std_level=std_level,  # type: ignore[arg-type]
        mean_leave1out=leave1out,
        group_ids=groups,
        eps=1e-5,
    )
    expected = ref.normalize_tokens(
        x.tolist(),
        mask.tolist(),
        groups.tolist(),
        mean_level=mean_level,
        std_level=std_level,
        leave1out=leave1out,
        unbiased=True,
        eps=1e-5,
    )
    assert_close(out, torch.tensor(expected), rtol=1e-4, atol=1e-4)


def test_masked_positions_do_not_leak(gen: torch.Generator) -> None:
    x = torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) < 0.6
    dirty = torch.where(mask, x, torch.tensor(1e9))
    a = normalize(x, mask, mean_level="group", std_level="batch", group_ids=[0, 0, 1, 1])
    b = normalize(dirty, mask, mean_level="group", std_level="batch", group_ids=[0, 0, 1, 1])
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
        NormSpec("group", True, None),
        NormSpec("group", False, "group"),
        NormSpec("batch", False, "batch"),
    ):
        padded = normalize_with(x, spec, mask, group_ids=[0, 0, 1, 1])
        packed = normalize_with(packed_x, spec, packed_m, group_ids=[0, 0, 1, 1], cu_seqlens=cu)
        assert_close(packed, padded[valid], rtol=1e-6, atol=1e-6)


def test_group_index_fallback_and_errors() -> None:
    assert group_index_from_ids(None, 6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    assert group_index_from_ids(["x", "y", "x"], 3).tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="group_size=4"):
        group_index_from_ids(None, 6, 4)
    with pytest.raises(ValueError, match="3 entries for 2"):
        group_index_from_ids([1, 2, 3], 2)
    with pytest.raises(ValueError, match="mean_leave1out=true needs a mean_level"):
        normalize(torch.ones(3), mean_level=None, mean_leave1out=True)
    with pytest.raises(ValueError, match="mean_level must be"):
        normalize_with(torch.ones(3), NormSpec(mean_level="prompt"))  # type: ignore[arg-type]


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
