"""Policy-gradient surrogates: per-token losses from ratios and advantages.

Every surrogate has the `Surrogate` signature and returns per-token losses (to be
multiplied by the behaviour weight and aggregated by the caller) plus boolean masks of
where it clipped. With ρ the ratio π_θ/π_prox (token or GSPO sequence ratio) and A the
advantage (no gradient):

* `clip` (PPO, DAPO clip-higher, dual clip):
      l = max(-A ρ, -A clip(ρ, 1 - ε_low, 1 + ε_high))
      l = min(l, -c A)  for A < 0 when c_clip is set  (dual clip binds only there)
* `sapo` (soft gates, SAPO): with τ = τ_pos if A > 0 else τ_neg,
      l = -A · (4/τ) σ(τ (ρ - 1))
  whose gradient at ρ = 1 is exactly the policy gradient -A ∇ρ (σ'(0) · 4 = 1).
* `cispo` (MiniMax-M1): l = -sg(clip(ρ, 1 - ε_low, 1 + ε_high)) · A · log π_θ,
  so every token keeps a gradient, scaled by the clipped, stop-gradient weight.

The contract (`Surrogate`, `SurrogateParams`, `SurrogateOutput`) is defined in
`services.api` and re-exported here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from services.core.contracts import Surrogate, SurrogateOutput, SurrogateParams
from services.core.plugins import Registry, accepts_positional


def _fits_surrogate(obj: object) -> bool:
    """Callable with the four positional arguments of `Surrogate`."""
    return callable(obj) and accepts_positional(obj, 4)


# `actor.surrogate` names one of these, or a dotted path to a function of the same signature.
SURROGATES: Registry[Surrogate] = Registry("surrogate (actor.surrogate)", validate=_fits_surrogate)


@SURROGATES.register("clip")
def clip_surrogate(
    ratio: Tensor, advantages: Tensor, logprobs: Tensor, params: SurrogateParams
) -> SurrogateOutput:
    """PPO clipped surrogate with optional asymmetric upper bound and dual clip."""
    a = advantages.detach()
    unclipped = -a * ratio
    clipped_ratio = ratio.clamp(1.0 - params.eps_low, 1.0 + params.eps_high)
    clipped = -a * clipped_ratio
    loss = torch.maximum(unclipped, clipped)
    clip_mask = clipped.detach() > unclipped.detach()
    if params.c_clip is not None:
        dual = -params.c_clip * a
        dual_mask = (a < 0) & (dual < loss.detach())
        loss = torch.where(dual_mask, dual, loss)
    else:
        dual_mask = torch.zeros_like(clip_mask)
    return SurrogateOutput(loss, clip_mask, dual_mask)


@SURROGATES.register("sapo")
def sapo_surrogate(
    ratio: Tensor, advantages: Tensor, logprobs: Tensor, params: SurrogateParams
) -> SurrogateOutput:
    """SAPO: sigmoid soft gates instead of the hard clip, temperatures by advantage sign."""
    a = advantages.detach()
    gate_pos = torch.sigmoid(params.sapo_tau_pos * (ratio - 1.0)) * (4.0 / params.sapo_tau_pos)
    gate_neg = torch.sigmoid(params.sapo_tau_neg * (ratio - 1.0)) * (4.0 / params.sapo_tau_neg)
    gate = torch.where(a > 0, gate_pos, gate_neg)
    none = torch.zeros_like(ratio, dtype=torch.bool)
    extra = {  # AReaL's sapo_loss_fn statistics
        "sapo_soft_gate": gate.detach(),
        "sapo_scaled_gate_pos": gate_pos.detach(),
        "sapo_scaled_gate_neg": gate_neg.detach(),
    }
    return SurrogateOutput(-a * gate, none, none.clone(), extra)


@SURROGATES.register("cispo")
def cispo_surrogate(
    ratio: Tensor, advantages: Tensor, logprobs: Tensor, params: SurrogateParams
) -> SurrogateOutput:
    """CISPO: REINFORCE on log π_θ weighted by the clipped, stop-gradient ratio."""
    a = advantages.detach()
    r = ratio.detach()
    low, high = 1.0 - params.eps_low, 1.0 + params.eps_high
    weight = r.clamp(max(low, 0.0), high)
    clip_mask = (r < low) | (r > high)
    loss = -weight * a * logprobs
    return SurrogateOutput(loss, clip_mask, torch.zeros_like(clip_mask))


__all__ = [
    "SURROGATES",
    "Surrogate",
    "SurrogateOutput",
    "SurrogateParams",
    "cispo_surrogate",
    "clip_surrogate",
    "sapo_surrogate",
]
