"""Scalar reward shaping before advantages: DAPO overlong penalty, bias, scaling, clip.

Order (AReaL's): overlong penalty → `(r + reward_bias) * reward_scaling` →
clip to `[-reward_clip, reward_clip]` → `reward_norm` (in `advantages.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(
    response_lens: Tensor,
    *,
    max_new_tokens: int,
    overlong_tokens: int,
    overlong_penalty_factor: float,
) -> Tensor:
    """DAPO soft overlong punishment per sequence (<= 0), AReaL's formula.

        L_exp = max_new_tokens - overlong_tokens
        penalty = min(-factor * (L - L_exp) / overlong_tokens, 0)

    0 up to `L_exp` generated tokens, then linear in the excess: `-factor` at
    `max_new_tokens` and below it past that (not capped), as AReaL 2.0's
    `reward_overlong_penalty` (areal/utils/functional/functional.py) computes it.
    """
    if overlong_tokens is None or overlong_tokens < 1:
        raise ValueError(f"overlong_tokens must be >= 1, got {overlong_tokens!r}")
    if overlong_penalty_factor is None or overlong_penalty_factor < 0:
        raise ValueError(f"overlong_penalty_factor must be >= 0, got {overlong_penalty_factor!r}")
    if max_new_tokens is None or max_new_tokens < overlong_tokens:
        raise ValueError(
            f"max_new_tokens ({max_new_tokens!r}) must be >= overlong_tokens ({overlong_tokens})"
        )
    expected = max_new_tokens - overlong_tokens
    excess = (response_lens.to(torch.float32) - expected) / overlong_tokens
    return (-overlong_penalty_factor * excess).clamp(max=0.0)


def shape_rewards(
    rewards: Tensor,
    *,
    reward_bias: float = 0.0,
    reward_scaling: float = 1.0,
    reward_clip: float = 20.0,
) -> Tensor:
    """`clip((r + reward_bias) * reward_scaling, -reward_clip, reward_clip)`."""
    if not reward_clip > 0:
        raise ValueError(f"reward_clip must be > 0, got {reward_clip!r}")
    out = (rewards.to(torch.float32) + reward_bias) * reward_scaling
    return out.clamp(-reward_clip, reward_clip)
