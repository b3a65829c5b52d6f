"""Per-trajectory GAE λ functions (`actor.gae_lambda` given as a name or dotted path).

A λ function receives a context of `[B]` tensors and returns one λ per trajectory:

* `effective_token_lengths`: generated (loss_mask) tokens per trajectory;
* `turn_counts`: non-empty generated turns (0 when there are no `turn_ids`);
* `timestep_lengths`: the GAE horizon L — tokens in token mode, turns in turn mode.

Built-ins (kwargs from `actor.gae_lambda_kwargs`):

| name | kwargs | λ |
| --- | --- | --- |
| `constant` | `value` in [0, 1] | `value` |
| `vapo_length_adaptive` | `alpha > 0` | `max(0, 1 - 1/(alpha L))`, 0 for L = 0 |
| `relative_position` | `0 < q <= 1` | `q^(1/(L-1))` for L >= 2, 1 for L = 1, 0 for L = 0 |

`relative_position` keeps a fraction q of the signal from the last step at the first step
(with γ = 1). AReaL's dotted paths of the two length-aware functions are accepted as aliases.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from services.core.contracts import GaeLambdaFn  # the contract: fn(context, **kwargs) -> Tensor[B]
from services.core.plugins import Registry

GAE_LAMBDA_FNS: Registry[GaeLambdaFn] = Registry("GAE lambda function", validate=callable)


@GAE_LAMBDA_FNS.register("constant")
def constant_lambda(context: Mapping[str, Tensor], value: float = 1.0) -> Tensor:
    """The same λ for every trajectory."""
    lengths = context["timestep_lengths"]
    return torch.full(lengths.shape, float(value), dtype=torch.float32, device=lengths.device)


@GAE_LAMBDA_FNS.register("vapo_length_adaptive")
def vapo_length_adaptive(context: Mapping[str, Tensor], alpha: float = 0.05) -> Tensor:
    """VAPO's length-adaptive λ = 1 - 1/(alpha L): long trajectories get λ close to 1."""
    if not alpha > 0:
        raise ValueError(f"gae_lambda_kwargs.alpha must be > 0, got {alpha!r}")
    length = context["timestep_lengths"].to(torch.float32)
    lam = 1.0 - 1.0 / (alpha * length.clamp(min=1.0))
    return torch.where(length > 0, lam.clamp(min=0.0), 0.0)


@GAE_LAMBDA_FNS.register("relative_position")
def relative_position(context: Mapping[str, Tensor], q: float = 0.5) -> Tensor:
    """λ = q^(1/(L-1)): the first step keeps a fraction q of the last step's TD error."""
    if not 0 < q <= 1:
        raise ValueError(f"gae_lambda_kwargs.q must be in (0, 1], got {q!r}")
    length = context["timestep_lengths"].to(torch.float32)
    lam = torch.pow(torch.tensor(float(q)), 1.0 / (length - 1.0).clamp(min=1.0))
    lam = torch.where(length >= 2, lam, torch.where(length == 1, 1.0, 0.0))
    return lam.to(torch.float32)


GAE_LAMBDA_FNS.alias("areal.trainer.ppo.lambda_fn.vapo_length_adaptive_gae", "vapo_length_adaptive")
GAE_LAMBDA_FNS.alias(
    "areal.trainer.ppo.lambda_fn.relative_position_gae_lambda", "relative_position"
)


def gae_lambda_context(
    loss_mask: Tensor, turn_ids: Tensor | None = None, gae_timestep_unit: str = "token"
) -> dict[str, Tensor]:
    """The context a λ function receives, from a padded `[B, T]` loss mask (and turn ids).

    `effective_token_lengths` = generated tokens per trajectory, `turn_counts` = non-empty
    generated turns (0 without `turn_ids`), `timestep_lengths` = the GAE horizon (tokens,
    or turns when `gae_timestep_unit` is `turn`), as AReaL's `_build_gae_lambda_context`
    (`areal/trainer/ppo/gae.py`). `compute_advantages` builds its context with this.
    """
    from .gae import turn_slots  # gae imports nothing from here; keep the module light

    if gae_timestep_unit not in ("token", "turn"):
        raise ValueError(f"gae_timestep_unit must be 'token' or 'turn', got {gae_timestep_unit!r}")
    mask = loss_mask.to(torch.bool)
    n = mask.shape[0]
    if turn_ids is not None:
        _, _, turn_counts = turn_slots(mask, turn_ids)
    elif gae_timestep_unit == "turn":
        raise ValueError("gae_timestep_unit='turn' needs turn_ids (multi-turn trajectories)")
    else:
        turn_counts = torch.zeros(n, dtype=torch.int64, device=mask.device)
    tokens = mask.sum(dim=1)
    return {
        "effective_token_lengths": tokens,
        "turn_counts": turn_counts,
        "timestep_lengths": turn_counts if gae_timestep_unit == "turn" else tokens,
    }


def resolve_gae_lambda(
    gae_lambda: float | str,
    context: Mapping[str, Tensor],
    gae_lambda_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """One λ per trajectory from a number, a registered name or a dotted path; validated."""
    lengths = context["timestep_lengths"]
    n = lengths.shape[0]
    if isinstance(gae_lambda, bool):
        raise ValueError(f"gae_lambda must be a number or a function path, got {gae_lambda!r}")
    if isinstance(gae_lambda, int | float):
        lam = torch.full((n,), float(gae_lambda), dtype=torch.float32, device=lengths.device)
        source = f"gae_lambda={gae_lambda!r}"
    else:
        fn = GAE_LAMBDA_FNS.get(gae_lambda)
        lam = fn(context, **dict(gae_lambda_kwargs or {}))
        source = f"gae_lambda function {gae_lambda!r}"
        if not isinstance(lam, Tensor):
            raise ValueError(f"{source} returned {type(lam).__name__}, expected a tensor [{n}]")
        if lam.shape != (n,):
            raise ValueError(f"{source} returned shape {tuple(lam.shape)}, expected [{n}]")
        if not lam.dtype.is_floating_point:
            raise ValueError(f"{source} returned dtype {lam.dtype}, expected floating point")
        lam = lam.to(device=lengths.device, dtype=torch.float32)
    if not bool(torch.isfinite(lam).all()):
        raise ValueError(f"{source} gave a non-finite lambda")
    if bool(((lam < 0) | (lam > 1)).any()):
        bad = lam[(lam < 0) | (lam > 1)][0].item()
        raise ValueError(f"{source} gave lambda={bad}; GAE lambda must lie in [0, 1]")
    return lam
