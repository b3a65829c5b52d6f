"""The actor loss of the PPO family and the critic loss, each returning `(loss, stats)`.

Actor, per token t (all pieces optional and composable):

    ρ_t  = π_θ(t) / π_prox(t)                      importance_sampling_level = token
    ρ_t  = exp(mean_{t' in seq} log ρ_t')          importance_sampling_level = sequence (GSPO),
           with A_t replaced by the sequence mean of A
    w_t  = π_prox(t) / π_behave(t)                 decoupled PPO behaviour weight (no grad),
           filtered or clamped by rejection sampling (IcePop, KPop)
    m_t  = loss_mask, minus M2PO-masked tokens (by (log π_behave - log π_prox)^2), minus
           tokens rejection sampling drops
    l_t  = surrogate(ρ_t, A_t, log π_θ(t))          clip | sapo | cispo (see surrogates.py)
    loss = aggregate(w_t · l_t over m_t)           token-mean | seq-mean-token-mean | ...
           (+ the teacher term of on-policy distillation when teacher log-probs are given)

Without the decoupled loss, π_prox is π_old (the behaviour log-probabilities, or their
recomputation) and w_t = 1. Critic:

    V_clip = V_old + clip(V - V_old, -ε, ε)
    l_t    = max(f(V, G), f(V_clip, G)),   f = ½(x - G)² (mse) or Huber(δ), δ = 10 (AReaL)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from services.common.config.views import ActorLossView, CriticLossView

from .aggregation import aggregate_loss
from .checks import require_finite
from .layout import SeqLayout, check_same_shape, layout_of, seq_broadcast, seq_sum
from .offpolicy import apply_rejection_sampling, behave_imp_weight, m2po_mask
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
    settings: ActorLossView,
    *,
    behave_logprobs: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    entropy: Tensor | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-family actor loss (module docstring) → (scalar loss with grad, stats).

    `settings` is the actor config's loss view (`ActorLossView.of(actor, teacher)`),
    validated at load. Per-token tensors share one layout: padded `[B, T]` or packed `[N]`
    with `cu_seqlens`. `logprobs` is π_θ (with grad); `proximal_logprobs` π_prox (or π_old
    without the decoupled loss); `behave_logprobs` π_behave (needed by the decoupled loss,
    rejection sampling and M2PO); `teacher_logprobs` the teacher's (on-policy distillation,
    weighted by `settings.distillation`). `normalizer` is the minibatch-wide denominator
    (see `aggregation.py`); `versions` / `current_version` only feed the staleness
    statistics; `attention_mask` (the positions that hold a token, prompt included) only
    feeds the token counts: without it every position of the layout counts (right for the
    packed layout, which has no padding).

    The steps, in AReaL's order (`grpo_loss_fn` and `ppo_actor_loss_fn`), one function each:
    `m2po_step` masks the call's loss tokens first (the statistics mask); `behaviour_step`
    weighs them by π_prox/π_behave and lets rejection sampling narrow the loss mask;
    `policy_ratio` and the surrogate give the per-token loss; `m2po_normalizer` keeps the
    post-M2PO count as the denominator (AReaL divides each micro-batch by its own post-M2PO
    count and weighs it by its pre-M2PO count); `distillation_loss` adds or replaces the RL
    term with the teacher's.

    Stats: per-token tensors under AReaL's names (`importance_weight`, `approx_kl`,
    `clip_mask`, `dual_clip_mask`, `loss`, `loss_mask` — the statistics mask —, and with
    the decoupled loss `behave_imp_weight`, `behave_mask`, `behave_approx_kl`, with rejection
    sampling `filtered_fraction`; `sapo_*` gates, `entropy`, `rkl_loss` when they apply) and
    0-d scalars (`actor_loss`, M2PO, staleness, and the token counts of AReaL 2.0's
    `ppo_actor_loss_fn`). `stats.ACTOR_TOKEN_STATS` says how the per-token ones are
    reported; `stats.summarize_token_stats` reduces them. The token counts, with
    N = the call's token positions (`attention_mask` count) and V = its loss tokens after
    M2PO, before rejection sampling:

        n_total_tokens = N,  n_valid_tokens = V,  n_masked_tokens = N - V,
        masked_token_ratio = 1 - V / max(N, 1)
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
        teacher_logprobs=teacher_logprobs,
        attention_mask=attention_mask,
    )
    orig_mask = loss_mask.to(torch.bool)
    _check_inputs(settings, orig_mask, attention_mask, behave_logprobs, teacher_logprobs)
    require_finite(
        orig_mask,
        "loss tokens",
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        advantages=advantages,
        behave_logprobs=behave_logprobs,
        teacher_logprobs=teacher_logprobs,
    )
    prox = proximal_logprobs.detach()
    behave = None if behave_logprobs is None else behave_logprobs.detach()

    stat_mask, stats = m2po_step(prox, behave, orig_mask, settings.m2_threshold)
    behaviour = behaviour_step(prox, behave, stat_mask, settings, cu_seqlens)
    stats.update(behaviour.stats)
    mask = behaviour.loss_mask
    ratio, adv = policy_ratio(
        logprobs, prox, advantages.detach(), stat_mask, mask, settings, layout
    )
    params = SurrogateParams(
        settings.eps_clip,
        settings.eps_clip_higher,
        settings.c_clip,
        settings.sapo_tau_pos,
        settings.sapo_tau_neg,
    )
    cispo = settings.surrogate == "cispo"
    lp = torch.where(mask, logprobs, 0.0) if cispo else logprobs
    out = SURROGATES.get(settings.surrogate)(ratio, adv, lp, params)
    per_token = out.per_token_loss
    if behaviour.weight is not None:
        per_token = per_token * behaviour.weight

    def agg(values: Tensor, keep: Tensor) -> Tensor:
        return aggregate_loss(  # masks values itself
            values,
            keep,
            settings.loss_agg_mode,
            denominator_mask=stat_mask,
            cu_seqlens=cu_seqlens,
            normalizer=m2po_normalizer(normalizer, orig_mask, stat_mask, settings.m2_threshold),
            constant=settings.loss_agg_norm,
        )

    if teacher_logprobs is None:
        loss = agg(per_token, mask)
    else:
        old = behave if settings.use_decoupled_loss and behave is not None else prox
        loss, stats["rkl_loss"] = distillation_loss(
            logprobs, old, teacher_logprobs.detach(), stat_mask, per_token, mask, settings, agg
        )

    clip_over = mask if cispo else stat_mask  # AReaL's cispo_loss_fn
    stats.update(
        importance_weight=ratio.detach(),
        approx_kl=torch.where(stat_mask, logprobs.detach() - prox, 0.0),
        clip_mask=out.clipped & clip_over,
        dual_clip_mask=out.dual_clipped & stat_mask,
        loss=torch.where(mask, per_token.detach(), 0.0),
        loss_mask=stat_mask,
        actor_loss=scalar(loss),
        **token_counts(stat_mask.sum(), attention_mask, orig_mask),
    )
    stats.update(out.extra)
    if entropy is not None:
        stats["entropy"] = entropy.detach()
    if versions is not None and current_version is not None:
        stats.update(staleness_stats(versions, current_version, orig_mask))
    return loss, stats


def _check_inputs(
    settings: ActorLossView,
    loss_mask: Tensor,
    attention_mask: Tensor | None,
    behave_logprobs: Tensor | None,
    teacher_logprobs: Tensor | None,
) -> None:
    """The tensors the settings need are given (the settings themselves were validated at
    load, by the schema)."""
    if settings.use_decoupled_loss and behave_logprobs is None:
        raise ValueError(
            "use_decoupled_loss=True needs behave_logprobs (π_behave from the rollout)"
        )
    if settings.m2_threshold is not None and behave_logprobs is None:
        raise ValueError(
            "m2_threshold (M2PO) needs behave_logprobs: it masks by log π_behave - log π_prox"
        )
    if teacher_logprobs is not None and settings.distillation is None:
        raise ValueError("teacher_logprobs needs the teacher config (its loss weights)")
    if attention_mask is not None and bool((loss_mask & ~attention_mask.to(torch.bool)).any()):
        raise ValueError("loss_mask has tokens where attention_mask is 0 (padding)")


def m2po_step(
    prox: Tensor, behave: Tensor | None, loss_mask: Tensor, m2_threshold: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Step 1, the mask: M2PO on the call's loss tokens (AReaL: before the loss function),
    by (log π_behave - log π_prox)². Returns the statistics mask and M2PO's stats."""
    if m2_threshold is None:
        return loss_mask, {}
    assert behave is not None
    return m2po_mask(behave - prox, loss_mask, m2_threshold)


@dataclass
class Behaviour:
    """Step 2's result: the weight the per-token loss is multiplied by (None: no weight),
    the loss mask after rejection sampling, and the statistics."""

    weight: Tensor | None
    loss_mask: Tensor
    stats: dict[str, Tensor]


def behaviour_step(
    prox: Tensor,
    behave: Tensor | None,
    mask: Tensor,
    settings: ActorLossView,
    cu_seqlens: Tensor | None,
) -> Behaviour:
    """Step 2, the behaviour weight of decoupled PPO, w_t = π_prox(t)/π_behave(t) (no grad;
    `offpolicy.behave_imp_weight`), filtered or clamped by rejection sampling, which also
    narrows the loss mask. Without the decoupled loss, w_t = 1 and the mask stays;
    `decoupled_correction: none` reports w_t but does not apply it."""
    if not settings.use_decoupled_loss:
        return Behaviour(None, mask, {})
    assert behave is not None
    stats: dict[str, Tensor] = {}
    loss_mask = mask
    if settings.rejection_sampling is not None:
        rs = apply_rejection_sampling(
            prox, behave, mask, settings.rejection_sampling, cu_seqlens=cu_seqlens
        )
        loss_mask, weight = rs.loss_mask, rs.behave_imp_weight
        stats["filtered_fraction"] = rs.filtered_fraction
        stats["rs_filtered_fraction"] = rs.filtered_fraction
    else:
        weight = behave_imp_weight(prox, behave, mask)
    behave_mask = (weight > 0) & loss_mask
    stats["behave_imp_weight"] = weight.detach()
    stats["behave_mask"] = behave_mask
    stats["behave_approx_kl"] = torch.where(behave_mask, prox - behave, 0.0)
    applied = None if settings.decoupled_correction == "none" else weight
    return Behaviour(applied, loss_mask, stats)


def policy_ratio(
    logprobs: Tensor,
    prox: Tensor,
    advantages: Tensor,
    stat_mask: Tensor,
    loss_mask: Tensor,
    settings: ActorLossView,
    layout: SeqLayout,
) -> tuple[Tensor, Tensor]:
    """Step 3, the ratio ρ = π_θ/π_prox (0 off the mask, as AReaL) and the advantages the
    surrogate sees: per token, or per sequence (GSPO: the geometric-mean ratio and the
    mean advantage over the loss mask, broadcast to the tokens)."""
    if settings.importance_sampling_level == "sequence":
        log_ratio = torch.where(loss_mask, logprobs - prox, 0.0)
        ratio, adv = sequence_ratio_and_advantages(log_ratio, advantages, loss_mask, layout)
        return torch.where(loss_mask, ratio, 0.0), torch.where(loss_mask, adv, 0.0)
    log_ratio = torch.where(stat_mask, logprobs - prox, 0.0)
    return torch.where(stat_mask, torch.exp(log_ratio), 0.0), advantages


def m2po_normalizer(
    normalizer: float | Tensor | None,
    orig_mask: Tensor,
    stat_mask: Tensor,
    m2_threshold: float | None,
) -> float | Tensor | None:
    """Step 4, the aggregation's denominator: the post-M2PO count. With a minibatch-wide
    `normalizer` the sum is scaled by N_before/N_after M2PO (see `aggregation.py`)."""
    n_stat = int(stat_mask.sum())
    if m2_threshold is None or normalizer is None or n_stat == 0:
        return normalizer
    return float(normalizer) * n_stat / int(orig_mask.sum())


def distillation_loss(
    logprobs: Tensor,
    old: Tensor,
    teacher: Tensor,
    stat_mask: Tensor,
    per_token: Tensor,
    loss_mask: Tensor,
    settings: ActorLossView,
    agg: Callable[[Tensor, Tensor], Tensor],
) -> tuple[Tensor, Tensor]:
    """Step 5, on-policy distillation against a teacher (AReaL 2.0 `grpo_loss_fn`), over
    the M2PO mask → (loss, per-token `rkl_loss`). With `rl_loss_weight` > 0:

        loss = rl_loss_weight · L_RL + distill_loss_weight · agg(log π_θ - log π_teacher)

    With `rl_loss_weight` = 0 the RL term is dropped:

        loss = -distill_loss_weight · agg(w · sg(log π_teacher - log π_θ)),  w = π_θ/π_old

    (π_old: π_behave with the decoupled loss, else π_prox)."""
    assert settings.distillation is not None
    weights = settings.distillation
    if weights.rl_loss_weight == 0:
        w = torch.exp(torch.where(stat_mask, logprobs - old, 0.0))
        term = w * torch.where(stat_mask, teacher - logprobs.detach(), 0.0)
        loss = -weights.distill_loss_weight * agg(term, stat_mask)
        return loss, torch.where(stat_mask, -term.detach(), 0.0)
    penalty = torch.where(stat_mask, logprobs - teacher, 0.0)
    loss = weights.rl_loss_weight * agg(per_token, loss_mask) + (
        weights.distill_loss_weight * agg(penalty, stat_mask)
    )
    return loss, penalty.detach()


def staleness_stats(versions: Tensor, current_version: int, mask: Tensor) -> dict[str, Tensor]:
    """`staleness_avg|min|max`: current_version - version over the generated loss tokens."""
    gen = mask & (versions >= 0)
    staleness = (current_version - versions).to(torch.float32)
    lo, hi = masked_min_max(staleness, gen)
    return {"staleness_avg": masked_mean(staleness, gen), "staleness_min": lo, "staleness_max": hi}


def token_counts(
    n_valid: Tensor, attention_mask: Tensor | None, loss_mask: Tensor
) -> dict[str, Tensor]:
    """AReaL 2.0's token counts of one loss call (`ppo_actor_loss_fn`,
    areal/utils/functional/functional.py): N token positions (`attention_mask`'s count,
    else every position of `loss_mask`), V = `n_valid` loss tokens;
    `n_masked_tokens = N - V`, `masked_token_ratio = 1 - V / max(N, 1)`."""
    n_total = loss_mask.numel() if attention_mask is None else attention_mask.to(torch.bool).sum()
    total = scalar(n_total, device=loss_mask.device)
    valid = scalar(n_valid)
    return {
        "n_total_tokens": total,
        "n_valid_tokens": valid,
        "n_masked_tokens": total - valid,
        "masked_token_ratio": 1.0 - valid / total.clamp(min=1.0),
    }


def _huber(x: Tensor, target: Tensor, delta: float) -> Tensor:
    diff = (x - target).abs()
    return torch.where(diff < delta, 0.5 * diff.square(), delta * (diff - 0.5 * delta))


def critic_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    settings: CriticLossView,
    *,
    cu_seqlens: Tensor | None = None,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (module docstring) → (scalar loss with grad, stats).

    `settings` is the critic config's view (`CriticLossView.of(critic, actor)`), validated
    at load. `returns` are the GAE critic targets. Stats: AReaL's per-token
    `clip_mask` and `loss`, plus `new_value`, `old_value`, `target_value` and `loss_mask`
    (reported through `stats.CRITIC_TOKEN_STATS`), and the scalars `value_loss`,
    `n_valid_tokens`.
    """
    layout = layout_of(loss_mask, cu_seqlens)
    check_same_shape(layout, values=values, old_values=old_values, returns=returns)
    mask = loss_mask.to(torch.bool)
    require_finite(mask, "loss tokens", values=values, old_values=old_values, returns=returns)
    target = returns.detach()
    old = old_values.detach()

    def f(v: Tensor) -> Tensor:
        if settings.value_loss == "mse":
            return 0.5 * (v - target).square()
        return _huber(v, target, settings.huber_delta)

    unclipped = f(values)
    clipped = f(old + (values - old).clamp(-settings.eps_clip, settings.eps_clip))
    per_token = torch.maximum(unclipped, clipped)
    clip_mask = clipped.detach() > unclipped.detach()
    per_token = torch.where(mask, per_token, 0.0)
    loss = aggregate_loss(
        per_token,
        mask,
        settings.loss_agg_mode,
        cu_seqlens=cu_seqlens,
        normalizer=normalizer,
        constant=settings.loss_agg_norm,
    )
    stats = {
        "value_loss": scalar(loss),
        "n_valid_tokens": scalar(mask.sum()),
        "clip_mask": clip_mask & mask,
        "loss": per_token.detach(),
        "new_value": values.detach(),
        "old_value": old,
        "target_value": target,
        "loss_mask": mask,
    }
    return loss, stats


__all__: list[Any] = [
    "Behaviour",
    "behaviour_step",
    "critic_loss",
    "distillation_loss",
    "m2po_normalizer",
    "m2po_step",
    "policy_ratio",
    "ppo_actor_loss",
    "sequence_ratio_and_advantages",
    "staleness_stats",
    "token_counts",
]
