"""Per-token KL estimators (k1/k2/k3) and the symmetric binary KL of KPop.

With samples drawn from p and `log_ratio = log p(x) - log q(x)` (Schulman, "Approximating
KL divergence", 2020):

    k1 = log_ratio                              unbiased for KL(p||q), can be negative
    k2 = 0.5 * log_ratio**2                     biased, low variance, >= 0
    k3 = exp(-log_ratio) - 1 + log_ratio        unbiased for KL(p||q), >= 0

Used for the KL reward against the reference model (p = π_behave, q = π_ref; see
`kl_reward_estimate`, which clamps like AReaL's actor) and, unclamped, for rejection
sampling (p = π_prox, q = π_behave), as AReaL's `apply_rejection_sampling` does.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from services.core.plugins import Registry


class KLEstimator(Protocol):
    """`(logp, logq) -> per-token estimate of KL(p || q)` on samples from p."""

    def __call__(self, logp: Tensor, logq: Tensor) -> Tensor: ...


KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", validate=callable)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Tensor, logq: Tensor) -> Tensor:
    """k1 = log p - log q."""
    return logp - logq


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, logq: Tensor) -> Tensor:
    """k2 = (log p - log q)^2 / 2."""
    return 0.5 * (logp - logq).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Tensor, logq: Tensor) -> Tensor:
    """k3 = q/p - 1 - log(q/p), computed from the log ratio without overflow for q << p."""
    log_ratio = logq - logp
    return torch.expm1(log_ratio) - log_ratio


def kl_reward_estimate(logp: Tensor, logq: Tensor, estimator: str, clamp: float | None) -> Tensor:
    """The estimate behind the KL reward: `clamp(KL_est(logp, logq), -clamp, clamp)` in float32.

    `clamp` is `actor.kl_clamp`: its default 10 is AReaL's actor, which builds
    `KLEstimator(kl_estimator)` with `apply_clamp=True` (areal/utils/data.py), so every
    estimate is clamped to [-10, 10] before `kl_ctl` multiplies it; `clamp=None` turns the
    clamp off (`actor.kl_clamp: null`).
    """
    est = KL_ESTIMATORS.get(estimator)(logp.to(torch.float32), logq.to(torch.float32))
    return est if clamp is None else est.clamp(-clamp, clamp)


def bernoulli_kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(Bern(p) || Bern(q)) = p log(p/q) + (1-p) log((1-p)/(1-q)) from log-probabilities.

    Terms with p = 0 or p = 1 contribute their limit 0; `log1p(-exp(.))` keeps the
    complement accurate for tiny probabilities.
    """
    logp = logp.clamp(max=0.0)
    logq = logq.clamp(max=0.0)
    p = torch.exp(logp)
    log1m_p = torch.log1p(-p)
    log1m_q = torch.log1p(-torch.exp(logq))
    first = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))
    second = torch.where(p < 1, (1 - p) * (log1m_p - log1m_q), torch.zeros_like(p))
    return first + second


def binary_kl_symmetric(logp: Tensor, logq: Tensor) -> Tensor:
    """KPop's metric: max(KL(Bern(p)||Bern(q)), KL(Bern(q)||Bern(p))) per token."""
    return torch.maximum(bernoulli_kl(logp, logq), bernoulli_kl(logq, logp))
