"""The proximal policy π_prox of decoupled PPO, recomputed or approximated from versions.

Which weights each policy stands for at a training step. The trainer holds weights W_v,
where `current_version` = v is the number of optimizer rounds done so far and also the
version the rollout tags on tokens generated with W_v:

* π_behave(t): the weights W_{v_b(t)} that generated token t; `versions[t]` = v_b(t)
  (-1 on prompt tokens). Different tokens of one completion can carry different versions
  when weights change mid-generation.
* π_prox: W_v, the weights at the start of this step (what `recompute` evaluates).
  v_prox = current_version.
* π_θ: the parameters being optimised in this step. They start at W_v and become
  W_{v+1} when the step ends, so the interpolation places them at
  v_θ = current_version + 1 (`theta_version` overrides it, e.g. v + j/n_minibatches
  for the j-th minibatch, which makes the approximation exact at j = 0).

Methods:

* `recompute`: π_prox from a forward pass with W_v (`recomputed_logprobs`).
* `loglinear`: log π_prox ≈ log π_behave + α (log π_θ - log π_behave) — geometric
  interpolation in probability space; exact when log-probabilities move linearly in
  the version.
* `linear`: π_prox ≈ (1 - α) π_behave + α π_θ — arithmetic interpolation.
* `metrics`: `recompute`, plus the errors of `loglinear`, `linear` and `rollout`
  (π_prox ≈ π_behave, what training without a correction assumes) against it.
* `reuse_train_logp`: π_prox = π_θ detached, exact when each step is a single
  minibatch (`ppo_n_minibatches = 1`), where π_θ equals W_v during the loss.
* `rollout`: π_prox ≈ π_behave (function API only, not a config choice): what training
  without an off-policy correction assumes; the third approximation `metrics` measures.

with, per generated token,

    α = (v_prox - v_b) / (v_θ - v_b),   clamped to [0, 1], 0 where v_θ <= v_b.

AReaL writes the same formula with v_prox = current_version - 1 and v_θ = current_version,
and (as we read its trainer) passes the version of the weights it holds; tokens one
version behind (v_b = v - 1) then get α = 0, i.e. π_prox ≈ π_behave = W_{v-1}, although
π_prox is W_v. Flywheel passes the same `current_version` and shifts the formula instead.
`test_prox.py` pins the convention with policies whose log-probabilities are linear in the
version (where loglinear must be exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .checks import require_finite
from .stats import (
    PROX_APPROX_METHODS,
    masked_mean,
    scalar,
)

PROX_LOGP_METHODS: tuple[str, ...] = (
    "recompute",
    "loglinear",
    "linear",
    "metrics",
    "reuse_train_logp",
    "rollout",
)
_SKIPS_FORWARD = ("loglinear", "linear", "reuse_train_logp", "rollout")


def needs_recompute(method: str) -> bool:
    """True when `method` needs the extra forward pass with W_v before the update."""
    _check_method(method)
    return method not in _SKIPS_FORWARD


def _check_method(method: str) -> None:
    if method not in PROX_LOGP_METHODS:
        raise ValueError(
            f"unknown prox_logp_method {method!r}; valid: {', '.join(PROX_LOGP_METHODS)}"
        )


def interpolation_alpha(
    versions: Tensor, current_version: int, theta_version: float | Tensor | None = None
) -> Tensor:
    """α = (v_prox - v_b)/(v_θ - v_b) per token, clamped to [0, 1]; 0 on prompt tokens."""
    if versions.dtype.is_floating_point or versions.dtype == torch.bool:
        raise ValueError(f"versions must be an integer tensor, got {versions.dtype}")
    # Versions are small integers: exact in float32 (up to 2^24).
    v_b = versions.to(torch.float32)
    v_prox = float(current_version)
    if theta_version is None:
        v_theta: float | Tensor = v_prox + 1.0
    elif isinstance(theta_version, Tensor):
        v_theta = theta_version.to(device=versions.device, dtype=torch.float32)
    else:
        v_theta = float(theta_version)
    span = v_theta - v_b
    ok = (versions >= 0) & (span > 0)
    alpha = torch.where(ok, (v_prox - v_b) / torch.where(ok, span, 1.0), 0.0)
    return alpha.clamp(0.0, 1.0)


def approximate_prox_logp(
    method: str, behave_logprobs: Tensor, theta_logprobs: Tensor, alpha: Tensor
) -> Tensor:
    """`loglinear`, `linear` or `rollout` approximation of log π_prox (no gradient).

    With b = log π_behave, θ = log π_θ and α from `interpolation_alpha`:
    loglinear b + α (θ - b); linear log((1 - α) e^b + α e^θ); rollout b. Prompt and
    padding tokens are the caller's business (`compute_prox_logp` keeps b there).
    """
    b = behave_logprobs.detach().to(torch.float32)
    th = theta_logprobs.detach().to(torch.float32)
    if method == "loglinear":
        return b + alpha * (th - b)
    if method == "linear":
        # log((1-α) e^b + α e^θ) without under/overflow; log 0 = -inf drops a term.
        return torch.logaddexp(torch.log1p(-alpha) + b, torch.log(alpha) + th)
    if method == "rollout":
        return b
    raise ValueError(f"unknown approximation {method!r}; valid: {', '.join(PROX_APPROX_METHODS)}")


@dataclass
class ProxResult:
    """log π_prox (same layout as the inputs, no gradient) and its statistics."""

    prox_logprobs: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)


def _errors(approx: Tensor, truth: Tensor, mask: Tensor, prefix: str) -> dict[str, Tensor]:
    diff = approx - truth
    rel = diff.abs() / truth.abs().clamp(min=1e-8)
    return {
        f"{prefix}_abs_error": masked_mean(diff.abs(), mask),
        f"{prefix}_rel_error": masked_mean(rel, mask),
        f"{prefix}_sq_error": masked_mean(diff.square(), mask),
    }


def compute_prox_logp(
    method: str,
    *,
    theta_logprobs: Tensor,
    behave_logprobs: Tensor | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
    loss_mask: Tensor | None = None,
    recomputed_logprobs: Tensor | None = None,
    theta_version: float | Tensor | None = None,
    ppo_n_minibatches: int | None = None,
) -> ProxResult:
    """log π_prox by `method` (see the module docstring for versions and formulas).

    `theta_logprobs` are π_θ's log-probabilities from the training forward (used detached);
    `behave_logprobs` and `versions` come from the rollout; `recomputed_logprobs` from the
    forward pass with W_v (`recompute`, `metrics`). All per-token tensors share one layout.
    Non-finite inputs on generated tokens raise `ValueError`.
    """
    _check_method(method)
    mask = (
        torch.ones_like(theta_logprobs, dtype=torch.bool)
        if loss_mask is None
        else loss_mask.to(torch.bool)
    )
    for name, t in (
        ("behave_logprobs", behave_logprobs),
        ("versions", versions),
        ("recomputed_logprobs", recomputed_logprobs),
    ):
        if t is not None and t.shape != theta_logprobs.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but theta_logprobs has "
                f"{tuple(theta_logprobs.shape)}"
            )
    if mask.shape != theta_logprobs.shape:
        raise ValueError(
            f"loss_mask has shape {tuple(mask.shape)}, expected {tuple(theta_logprobs.shape)}"
        )
    stats: dict[str, Tensor] = {}

    if method == "reuse_train_logp":
        if ppo_n_minibatches is not None and ppo_n_minibatches != 1:
            raise ValueError(
                "prox_logp_method='reuse_train_logp' needs ppo_n_minibatches=1: with more "
                f"minibatches (got {ppo_n_minibatches}) π_θ has moved away from π_prox"
            )
        require_finite(mask, theta_logprobs=theta_logprobs)
        return ProxResult(theta_logprobs.detach().clone(), stats)

    if method in ("recompute", "metrics"):
        if recomputed_logprobs is None:
            raise ValueError(
                f"prox_logp_method={method!r} needs recomputed_logprobs (a forward with W_v)"
            )
        require_finite(mask, recomputed_logprobs=recomputed_logprobs)
        truth = recomputed_logprobs.detach().to(torch.float32)
        if method == "recompute":
            return ProxResult(truth, stats)

    if method == "rollout":
        if behave_logprobs is None:
            raise ValueError("prox_logp_method='rollout' needs behave_logprobs")
        require_finite(mask, behave_logprobs=behave_logprobs)
        return ProxResult(behave_logprobs.detach().to(torch.float32).clone(), stats)

    if behave_logprobs is None or versions is None or current_version is None:
        raise ValueError(
            f"prox_logp_method={method!r} needs behave_logprobs, versions and current_version"
        )
    generated = mask & (versions >= 0)
    require_finite(generated, behave_logprobs=behave_logprobs, theta_logprobs=theta_logprobs)
    alpha = interpolation_alpha(versions, current_version, theta_version)
    stats["prox_alpha"] = masked_mean(alpha, generated)

    if method in ("loglinear", "linear"):
        approx = approximate_prox_logp(method, behave_logprobs, theta_logprobs, alpha)
        # Prompt tokens and padding keep the behaviour value (never used by the loss).
        approx = torch.where(generated, approx, behave_logprobs.detach().to(torch.float32))
        require_finite(generated, approximated_prox_logprobs=approx)
        return ProxResult(approx, stats)

    # metrics: recomputed truth, plus the error of each approximation against it.
    b = behave_logprobs.detach().to(torch.float32)
    th = theta_logprobs.detach().to(torch.float32)
    for approx_name in PROX_APPROX_METHODS:
        approx = approximate_prox_logp(approx_name, b, th, alpha)
        prefix = f"prox_approx/{approx_name}"
        stats.update(_errors(approx, truth, generated, f"{prefix}/logp"))
        stats.update(
            _errors(
                torch.exp(approx - b),
                torch.exp(truth - b),
                generated,
                f"{prefix}/behave_imp_weight",
            )
        )
        stats.update(
            _errors(
                torch.exp(th - approx),
                torch.exp(th - truth),
                generated,
                f"{prefix}/importance_weight",
            )
        )
    return ProxResult(truth, {k: scalar(v) for k, v in stats.items()})
