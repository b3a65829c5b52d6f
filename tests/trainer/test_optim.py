"""The learning-rate schedule: hand-computed values, and state that survives a restart."""

from __future__ import annotations

import json
import math

import pytest
import torch

from services.common.config import OptimizerConfig
from services.trainer.optim import (
    build_optimizer,
    build_scheduler,
    load_scheduler_state,
    lr_factor,
    scheduler_state,
    warmup_steps,
)


def test_warmup_is_linear_and_never_zero() -> None:
    # W = 4: steps 0..3 get 1/4, 2/4, 3/4, 4/4 of the peak.
    got = [lr_factor(s, total=10, warmup=4, kind="constant", min_lr_ratio=0.0) for s in range(5)]
    assert got == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_reaches_the_floor_at_the_last_step() -> None:
    # total 11, warmup 1: decay over steps 1..10 (span = 11 - 1 - 1 = 9).
    f = [lr_factor(s, total=11, warmup=1, kind="cosine", min_lr_ratio=0.1) for s in range(12)]
    assert f[0] == 1.0  # (0 + 1) / 1
    assert f[1] == pytest.approx(1.0)  # progress 0
    # midpoint: step 1 + 4.5 is not integer; step 5.5 ~ check progress 4/9 at step 5:
    # 0.1 + 0.9 * 0.5 * (1 + cos(pi * 4/9))
    assert f[5] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
    assert f[10] == pytest.approx(0.1)
    assert f[11] == pytest.approx(0.1)  # stays at the floor past the end


def test_linear_decay() -> None:
    # warmup 0, total 5: span 4; step 2 is halfway: 1 - (1 - 0.2) * 0.5 = 0.6.
    assert lr_factor(2, total=5, warmup=0, kind="linear", min_lr_ratio=0.2) == pytest.approx(0.6)
    assert lr_factor(4, total=5, warmup=0, kind="linear", min_lr_ratio=0.2) == pytest.approx(0.2)


def test_unknown_kind_names_the_field() -> None:
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        lr_factor(3, total=5, warmup=0, kind="step", min_lr_ratio=0.0)


def test_warmup_steps_overrides_the_proportion() -> None:
    assert warmup_steps(OptimizerConfig(warmup_steps_proportion=0.1), 200) == 20
    assert warmup_steps(OptimizerConfig(warmup_steps=7, warmup_steps_proportion=0.1), 200) == 7


def test_scheduler_state_is_json_and_resumes_the_same_lr() -> None:
    cfg = OptimizerConfig(lr=1e-2, lr_scheduler_type="cosine", warmup_steps=2, min_lr_ratio=0.1)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([p], cfg)
    sched = build_scheduler(opt, cfg, total_steps=10)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    state = json.loads(json.dumps(scheduler_state(sched)))
    opt2 = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    sched2 = build_scheduler(opt2, cfg, total_steps=10)
    load_scheduler_state(sched2, state)
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    # the 7th lr: factor(6) = 0.1 + 0.9 * 0.5 * (1 + cos(pi * 4/7)) with span 10 - 2 - 1 = 7
    assert opt2.param_groups[0]["lr"] == pytest.approx(
        1e-2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 7)))
    )
    assert lrs[:2] == pytest.approx([5e-3, 1e-2])
