"""Multi-turn reward discount: per-turn rewards → per-turn returns (AReaL's `turn_discount`).

Walking from the last turn to the first with a running value cur = 0:

    cur = cur · γ + r_i,    G_i = cur

so G_i = r_i + γ r_{i+1} + ... + γ^{T-1-i} r_{T-1}. A turn without a reward (`None`)
counts as 0. This is AReaL's `apply_reward_discount` (areal/experimental/openai/cache.py);
with 0/1 rewards where only the last turn can score, G_0 = γ^{T-1} r_{T-1}, the reward of
AReaL's `MultiTurnWorkflow` (areal/workflow/multi_turn.py).

Shared by the rollout's multi-turn workflow (which scores an episode with it) and the
trainer's algorithms; torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence


def discount_turn_rewards(
    rewards: Sequence[float | None], turn_discount: float = 1.0
) -> list[float]:
    """Per-turn returns G_i from per-turn rewards r_i (module docstring), same length.

    `turn_discount` γ must be in [0, 1]; a `None` reward is 0. The multi-turn workflow
    gives the episode the reward G_0 and keeps every G_i in the trajectory's metadata.
    """
    if not 0.0 <= turn_discount <= 1.0:
        raise ValueError(f"turn_discount must be in [0, 1], got {turn_discount!r}")
    out = [0.0] * len(rewards)
    cur = 0.0
    for i in range(len(rewards) - 1, -1, -1):
        r = rewards[i]
        cur = cur * turn_discount + (0.0 if r is None else float(r))
        out[i] = cur
    return out


__all__ = ["discount_turn_rewards"]
