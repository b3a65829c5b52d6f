"""The actor loss of the PPO family and the critic loss, each returning `(loss, stats)`.

Actor, per token t (all pieces optional and composable):

    ρ_t  = π_θ(t) / π_prox(t)                      importance_sampling_level = token
    ρ_t  = exp(mean_{t' in seq} log ρ_t')          importance_sampling_level = sequence (GSPO),
           with A_t replaced by the sequence mean of A
    w_t  = π_prox(t) / π_behave(t)                 decoupled PPO behaviour weight (no grad),
           filtered or clamped by rejection sampling (IcePop, KPop)
    m_t  = loss_mask, minus rejected tokens, minus M2PO-masked tokens (by π_prox/π_behave)
    l_t  = surrogate(ρ_t, A_t, log π_θ(t))          clip | sapo | cispo (see surrogates.py)
    loss = aggregate(w_t · l_t over m_t)           token-mean | seq-mean-token-mean | ...

Without the decoupled loss, π_prox is π_old (the behaviour log-probabilities, or their
recomputation) and w_t = 1. Critic:

    V_clip = V_old + clip(V - V_old, -ε, ε)
    l_t    = max(f(V, G), f(V_clip, G)),   f = ½(x - G)² (mse) or Huber(δ)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .aggregation import aggregate_loss
from .checks import require_finite
from .layout import SeqLayout, check_same_shape, layout_of, seq_broadcast, seq_sum
from .offpolicy import RejectionLike, apply_rejection_sampling, m2po_mask
from .stats import masked_mean, masked_min_max, scalar
from .surrogates import SURROGATES, SurrogateParams


def sequence_ratio_and_advantages(
    log_ratio: Tensor, advantages: Tensor, mask: Tensor, layout: SeqLayout
) -> tuple[Tensor, Tensor]:
    """GSPO: per-sequence geometric-mean ratio and mean advantage, broadcast to tokens."""
    n_tok = seq_sum(mask.to(log_ratio.dtype), layout).clamp(min=1)
    seq_log_ratio = seq_sum(torch.where(mask, log_ratio, 0.0), layout) / n_tok
    seq_adv = seq_sum(torch.where(mask, advantages, 0.0), layout) / n_tok
    return torch.exp(seq_broadcast(seq_log_ratio, layout)), seq_broadcast(seq_adv, layout)


def ppo_actor_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    behave_logprobs: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    surrogate: str = "clip",
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    importance_sampling_level: str = "token",
    use_decoupled_loss: bool = False,
    decoupled_correction: str = "behave_imp_weight",
    rejection_sampling: RejectionLike | None = None,
    m2_threshold: float | None = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | Tensor | None = None,
    loss_agg_norm: float | None = None,
    entropy: Tensor | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-family actor loss (module docstring) → (scalar loss with grad, stats).

    Per-token tensors share one layout: padded `[B, T]` or packed `[N]` with `cu_seqlens`.
    `logprobs` is π_θ (with grad); `proximal_logprobs` π_prox (or π_old without the
    decoupled loss); `behave_logprobs` π_behave (needed by the decoupled loss, rejection
    sampling and M2PO). `normalizer` is the minibatch-wide denominator (see
    `aggregation.py`); `versions` / `current_version` only feed the staleness statistics.
    M2PO judges log π_prox/π_behave, which does not change during a step, over the tokens
    of this call: give it whole minibatches (or accept a per-micro-batch threshold).
    """
    layout = layout_of(loss_mask, cu_seqlens)
    check_same_shape(
        layout,
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        advantages=advantages,
        behave_logprobs=behave_logprobs,
        entropy=entropy,
        versions=versions,
    )
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(
            f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}"
        )
    if surrogate == "cispo" and importance_sampling_level != "token":
        raise ValueError(
            "the cispo surrogate is token-level only; set importance_sampling_level='token'"
        )
    if decoupled_correction not in ("behave_imp_weight", "none"):
        raise ValueError(
            f"decoupled_correction must be 'behave_imp_weight' or 'none', got {decoupled_correction!r}"
        )
    if use_decoupled_loss and behave_logprobs is None:
        raise ValueError(
            "use_decoupled_loss=True needs behave_logprobs (π_behave from the rollout)"
        )
    if rejection_sampling is not None and not use_decoupled_loss:
        raise ValueError(
            "rejection_sampling acts on π_prox/π_behave and needs use_decoupled_loss=True "
            "(without it the two are the same policy)"
        )
    surrogate_fn = SURROGATES.get(surrogate)
    params = SurrogateParams(eps_clip, eps_clip_higher, c_clip, sapo_tau_pos, sapo_tau_neg)

    orig_mask = loss_mask.to(torch.bool)
    mask = orig_mask
    require_finite(
        mask,
        "loss tokens",
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        advantages=advantages,
        behave_logprobs=behave_logprobs,
    )
    stats: dict[str, Tensor] = {}
    prox = proximal_logprobs.detach()
    adv = advantages.detach()

    # Behaviour weight π_prox/π_behave (decoupled PPO), filtered by rejection sampling.
    behave_weight: Tensor | None = None
    if use_decoupled_loss:
        assert behave_logprobs is not None
        if rejection_sampling is not None:
            rs = apply_rejection_sampling(
                prox, behave_logprobs, mask, rejection_sampling, cu_seqlens=cu_seqlens
            )
            mask = rs.loss_mask
            behave_weight = rs.behave_imp_weight
            stats["rejection_filtered_fraction"] = rs.filtered_fraction
        else:
            log_w = torch.where(mask, prox - behave_logprobs.detach(), 0.0)
            behave_weight = torch.where(mask, torch.exp(log_w), 0.0)
        stats["behave_imp_weight"] = masked_mean(behave_weight, mask)
        stats["behave_approx_kl"] = masked_mean(prox - behave_logprobs.detach(), mask)
        if decoupled_correction == "none":
            behave_weight = None

    # M2PO second-moment mask on log π_prox/π_behave (π_θ = π_prox when the step starts).
    if m2_threshold is not None:
        if behave_logprobs is None:
            raise ValueError(
                "m2_threshold (M2PO) needs behave_logprobs: it masks by log π_prox/π_behave"
            )
        mask, m2_stats = m2po_mask(prox - behave_logprobs.detach(), mask, m2_threshold)
        stats.update(m2_stats)

    # Ratio and surrogate.
    log_ratio = torch.where(mask, logprobs - prox, 0.0)  # 0 (ratio 1) off the mask
    if importance_sampling_level == "sequence":
        ratio, adv = sequence_ratio_and_advantages(log_ratio, adv, mask, layout)
    else:
        ratio = torch.exp(log_ratio)
    lp = logprobs if surrogate != "cispo" else torch.where(mask, logprobs, 0.0)
    out = surrogate_fn(ratio, adv, lp, params)
    per_token = out.per_token_loss
    if behave_weight is not None:
        per_token = per_token * behave_weight

    loss = aggregate_loss(  # masks per_token itself
        per_token,
        mask,
        loss_agg_mode,
        denominator_mask=orig_mask,
        cu_seqlens=cu_seqlens,
        normalizer=normalizer,
        constant=loss_agg_norm,
    )

    n_kept = mask.sum()
    denom = n_kept.clamp(min=1).to(torch.float64)
    stats.update(
        actor_loss=scalar(loss),
        n_valid_tokens=scalar(n_kept),
        importance_weight=scalar(masked_mean(ratio, mask)),
        # log_ratio is already 0 off the mask
        approx_kl=scalar(log_ratio.detach().sum(dtype=torch.float64) / denom),
        clip_ratio=scalar((out.clipped & mask).sum() / denom),
        dual_clip_ratio=scalar((out.dual_clipped & mask).sum() / denom),
    )
    for name, value in out.extra.items():
        stats[name] = masked_mean(value, mask)
    if entropy is not None:
        stats["entropy"] = masked_mean(entropy, mask)
    if versions is not None and current_version is not None:
        gen = orig_mask & (versions >= 0)
        staleness = (current_version - versions).to(torch.float32)
        stats["staleness_avg"] = masked_mean(staleness, gen)
        stats["staleness_min"], stats["staleness_max"] = masked_min_max(staleness, gen)
    return loss, stats


def _huber(x: Tensor, target: Tensor, delta: float) -> Tensor:
    diff = (x - target).abs()
    return torch.where(diff < delta, 0.5 * diff.square(), delta * (diff - 0.5 * delta))


def critic_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    *,
    eps_clip: float | None = 0.5,
    value_loss: str = "mse",
    huber_delta: float = 1.0,
    cu_seqlens: Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | Tensor | None = None,
    loss_agg_norm: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (module docstring) → (scalar loss with grad, stats).

    `eps_clip=None` disables value clipping. `returns` are the GAE critic targets.
    """
    layout = layout_of(loss_mask, cu_seqlens)
    check_same_shape(layout, values=values, old_values=old_values, returns=returns)
    if value_loss not in ("mse", "huber"):
        raise ValueError(f"value_loss must be 'mse' or 'huber', got {value_loss!r}")
    if eps_clip is not None and not eps_clip > 0:
        raise ValueError(f"critic eps_clip must be > 0 (or null), got {eps_clip!r}")
    if value_loss == "huber" and not huber_delta > 0:
        raise ValueError(f"huber_delta must be > 0, got {huber_delta!r}")
    mask = loss_mask.to(torch.bool)
    require_finite(mask, "loss tokens", values=values, old_values=old_values, returns=returns)
    target = returns.detach()
    old = old_values.detach()

    def f(v: Tensor) -> Tensor:
        return (
            0.5 * (v - target).square() if value_loss == "mse" else _huber(v, target, huber_delta)
        )

    unclipped = f(values)
    if eps_clip is not None:
        v_clipped = old + (values - old).clamp(-eps_clip, eps_clip)
        clipped = f(v_clipped)
        per_token = torch.maximum(unclipped, clipped)
        clip_mask = clipped.detach() > unclipped.detach()
    else:
        per_token = unclipped
        clip_mask = torch.zeros_like(mask)
    per_token = torch.where(mask, per_token, 0.0)
    loss = aggregate_loss(
        per_token,
        mask,
        loss_agg_mode,
        cu_seqlens=cu_seqlens,
        normalizer=normalizer,
        constant=loss_agg_norm,
    )
    stats = {
        "value_loss": scalar(loss),
        "value_clip_ratio": masked_mean(clip_mask.to(torch.float32), mask),
        "values": masked_mean(values, mask),
        "returns": masked_mean(target, mask),
        "n_valid_tokens": scalar(mask.sum()),
    }
    return loss, stats


__all__: list[Any] = ["critic_loss", "ppo_actor_loss", "sequence_ratio_and_advantages"]
