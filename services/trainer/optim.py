"""The optimizer and its learning-rate schedule, built from `OptimizerConfig`.

The schedule is a pure function of the optimizer-step index (`lr_factor`), wrapped in a
`LambdaLR` whose state (`last_epoch`, base lrs) is plain numbers, so a checkpoint stores it
as JSON and a resumed run continues at exactly the same learning rate.

Warm-up is linear and never starts at zero: optimizer step s (0-based) of W warm-up steps
gets (s + 1) / W of the peak, so the first step moves a little and step W-1 is at the peak.
After warm-up: `constant` stays at the peak, `linear` falls linearly and `cosine` along a
half cosine to `min_lr_ratio` x peak at the last step of the schedule, and stays there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from services.common.config import OptimizerConfig


def warmup_steps(cfg: OptimizerConfig, total_steps: int) -> int:
    """`warmup_steps` when set, else `warmup_steps_proportion` of the schedule."""
    if cfg.warmup_steps is not None:
        return int(cfg.warmup_steps)
    return int(cfg.warmup_steps_proportion * total_steps)


def lr_factor(step: int, *, total: int, warmup: int, kind: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup - 1)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    if kind == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    if kind == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(
        f"optimizer.lr_scheduler_type={kind!r}: expected 'constant', 'linear' or 'cosine'"
    )


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig
) -> torch.optim.Optimizer:
    """AdamW for `adam` / `adam_bf16` (states follow the parameters' dtype, so bf16 master
    weights give bf16 states), plain SGD for `sgd`. Only parameters that require grad are
    optimized: with LoRA, the adapters (the frozen base weights get no state)."""
    params = [p for p in params if p.requires_grad]
    if cfg.type in ("adam", "adam_bf16"):
        return torch.optim.AdamW(
            params,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            foreach=False,
        )
    if cfg.type == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"optimizer.type={cfg.type!r}: expected 'adam', 'adam_bf16' or 'sgd'")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `total_steps` optimizer steps with the config's warm-up and shape."""
    if total_steps < 1:
        raise ValueError(f"the lr schedule needs at least one optimizer step, got {total_steps}")
    warm = warmup_steps(cfg, total_steps)
    kind, floor = cfg.lr_scheduler_type, cfg.min_lr_ratio
    lr_factor(0, total=total_steps, warmup=warm, kind=kind, min_lr_ratio=floor)  # validate
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, total=total_steps, warmup=warm, kind=kind, min_lr_ratio=floor),
    )


def scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict:
    """JSON-safe scheduler state (the lambdas are rebuilt from the config, not stored)."""
    state = scheduler.state_dict()
    return {k: v for k, v in state.items() if k != "lr_lambdas"}


def load_scheduler_state(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict) -> None:
    """Restore the schedule position and set the optimizer's lr to the value it implies
    (loading a scheduler alone leaves the optimizer's lr where it was)."""
    full = scheduler.state_dict()
    full.update({k: v for k, v in state.items() if k != "lr_lambdas"})
    scheduler.load_state_dict(full)
    step = scheduler.last_epoch
    for group, fn, base in zip(
        scheduler.optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs, strict=True
    ):
        group["lr"] = base * fn(step)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]  # noqa: SLF001
