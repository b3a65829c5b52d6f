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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from .registry import Registry


@dataclass(frozen=True)
class SurrogateParams:
    """Knobs of the surrogates (AReaL names in the comments)."""

    eps_clip: float = 0.2  # eps_clip (lower clip, and upper when eps_clip_higher is None)
    eps_clip_higher: float | None = None  # eps_clip_higher (DAPO clip-higher)
    c_clip: float | None = None  # c_clip (dual clip, > 1)
    sapo_tau_pos: float = 1.0  # sapo_tau_pos
    sapo_tau_neg: float = 1.05  # sapo_tau_neg

    @property
    def eps_low(self) -> float:
        return self.eps_clip

    @property
    def eps_high(self) -> float:
        return self.eps_clip if self.eps_clip_higher is None else self.eps_clip_higher


@dataclass
class SurrogateOutput:
    per_token_loss: Tensor
    clipped: Tensor  # bool: where the (upper/lower) clip decided the value
    dual_clipped: Tensor  # bool: where the dual clip decided the value
    extra: dict[str, Tensor] = field(default_factory=dict)  # per-token tensors for stats


class Surrogate(Protocol):
    """`(ratio, advantages, logprobs, params) -> SurrogateOutput`, all per token."""

    def __call__(
        self, ratio: Tensor, advantages: Tensor, logprobs: Tensor, params: SurrogateParams
    ) -> SurrogateOutput: ...


SURROGATES: Registry[Surrogate] = Registry("surrogate", validate=callable)


@SURROGATES.register("clip")
def clip_surrogate(
    ratio: Tensor, advantages: Tensor, logprobs: Tensor, params: SurrogateParams
) -> SurrogateOutput:
    """PPO clipped surrogate with optional asymmetric upper bound and dual clip."""
    if params.c_clip is not None and not params.c_clip > 1.0:
        raise ValueError(f"c_clip must be > 1, got {params.c_clip}")
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
    if not (params.sapo_tau_pos > 0 and params.sapo_tau_neg > 0):
        raise ValueError(
            f"sapo_tau_pos and sapo_tau_neg must be > 0, got {params.sapo_tau_pos}, "
            f"{params.sapo_tau_neg}"
        )
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
