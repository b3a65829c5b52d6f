"""`OptimizerConfig`: the optimizer and its learning-rate schedule (`actor.optimizer`),
AReaL's field names and defaults.

A block of its own because the actor, the critic and a trained teacher each carry one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import FlywheelModel


class OptimizerConfig(FlywheelModel):
    """AdamW/SGD settings and the learning-rate schedule."""

    type: Literal["adam", "sgd", "adam_bf16"] = "adam"
    """Optimizer: AdamW, plain SGD, or AdamW with bf16 states (needs FSDP)."""

    lr: float = Field(default=1e-3, gt=0.0)
    """Peak learning rate."""

    weight_decay: float = Field(default=0.01, ge=0.0)
    """Decoupled weight decay."""

    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    """Adam first-moment decay."""

    beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    """Adam second-moment decay."""

    eps: float = Field(default=1e-8, gt=0.0)
    """Adam denominator epsilon."""

    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """Learning rate at the end of annealing, as a fraction of `lr`."""

    lr_scheduler_type: Literal["linear", "cosine", "constant"] = "constant"
    """Shape of the schedule after warm-up."""

    warmup_steps_proportion: float = Field(default=0.001, ge=0.0, le=1.0)
    """Fraction of the total steps spent warming up (ignored when `warmup_steps` is set)."""

    warmup_steps: int | None = Field(default=None, ge=0)
    """Fixed number of warm-up steps; takes precedence over the proportion."""

    offload: bool = False
    """Keep optimizer states on CPU."""

    initial_loss_scale: float = 2.0**32
    """Initial dynamic loss scale (fp16 only)."""

    min_loss_scale: float = 1.0
    """Smallest dynamic loss scale (fp16 only)."""

    loss_scale_window: float = 5
    """Steps without overflow before the loss scale grows (fp16 only)."""

    hysteresis: int = 2
    """Overflows tolerated before the loss scale shrinks (fp16 only)."""

    gradient_clipping: float = Field(default=1.0, ge=0.0)
    """Global gradient-norm clip; 0 disables clipping."""
