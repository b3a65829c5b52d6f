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
    teacher_logprobs: Tensor | None = None,
    rl_loss_weight: float = 1.0,
    distill_loss_weight: float = 0.005,
    loss_agg_mode: str = "token-mean",
    normalizer: float | Tensor | None = None,
    loss_agg_norm: float | None = None,
    entropy: Tensor | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-family actor loss (module docstring) → (scalar loss with grad, stats).

    Per-token tensors share one layout: padded `[B, T]` or packed `[N]` with `cu_seqlens`.
    `logprobs` is π_θ (with grad); `proximal_logprobs` π_prox (or π_old without the
    decoupled loss); `behave_logprobs` π_behave (needed by the decoupled loss, rejection
    sampling and M2PO). `normalizer` is the minibatch-wide denominator (see
    `aggregation.py`); `versions` / `current_version` only feed the staleness statistics;
    `attention_mask` (the positions that hold a token, prompt included) only feeds the
    token counts: without it every position of the layout counts (right for the packed
    layout, which has no padding).

    Order of operations (AReaL's `grpo_loss_fn` and `ppo_actor_loss_fn`): M2PO masks the
    call's loss tokens first; rejection sampling narrows that mask for the loss; the
    statistics stay on the mask before rejection sampling. The denominator is the count
    after M2PO (AReaL divides each micro-batch by its own post-M2PO count and weighs it by
    its pre-M2PO count): with `normalizer` the sum is scaled by N_before/N_after M2PO.

    On-policy distillation (AReaL 2.0's teacher term; `teacher_logprobs` from a teacher
    model, over the M2PO mask): with `rl_loss_weight` > 0 the loss becomes
    `rl_loss_weight · L_RL + distill_loss_weight · mean(log π_θ - log π_teacher)`; with
    `rl_loss_weight` = 0 it is `-distill_loss_weight · mean(w · (log π_teacher - log π_θ))`,
    w = π_θ/π_old (π_old: π_behave with the decoupled loss, else `proximal_logprobs`) and
    the bracket detached: the RL term is dropped.

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
    # Argument checks of this public pure function: they guard direct callers (scripts,
    # notebooks, tests). Through the config the same rules fail earlier, at load
    # (`PPOActorConfig`), so the trainer never reaches them.
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
    if m2_threshold is not None and behave_logprobs is None:
        raise ValueError(
            "m2_threshold (M2PO) needs behave_logprobs: it masks by log π_behave - log π_prox"
        )
    if teacher_logprobs is not None and not (rl_loss_weight >= 0 and distill_loss_weight >= 0):
        raise ValueError(
            f"rl_loss_weight and distill_loss_weight must be >= 0, got {rl_loss_weight}, "
            f"{distill_loss_weight}"
        )
    surrogate_fn = SURROGATES.get(surrogate)
    params = SurrogateParams(eps_clip, eps_clip_higher, c_clip, sapo_tau_pos, sapo_tau_neg)

    orig_mask = loss_mask.to(torch.bool)
    require_finite(
        orig_mask,
        "loss tokens",
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        advantages=advantages,
        behave_logprobs=behave_logprobs,
        teacher_logprobs=teacher_logprobs,
    )
    if attention_mask is not None and bool((orig_mask & ~attention_mask.to(torch.bool)).any()):
        raise ValueError("loss_mask has tokens where attention_mask is 0 (padding)")
    stats: dict[str, Tensor] = {}
    prox = proximal_logprobs.detach()
    adv = advantages.detach()
    behave = None if behave_logprobs is None else behave_logprobs.detach()

    # 1. M2PO on the call's loss tokens (AReaL: before the loss function).
    stat_mask = orig_mask
    if m2_threshold is not None:
        assert behave is not None
        stat_mask, m2_stats = m2po_mask(behave - prox, orig_mask, m2_threshold)
        stats.update(m2_stats)
    mask = stat_mask  # narrowed by rejection sampling below; the stats stay on stat_mask

    # 2. Behaviour weight π_prox/π_behave (decoupled PPO), filtered by rejection sampling.
    behave_weight: Tensor | None = None
    if use_decoupled_loss:
        assert behave is not None
        if rejection_sampling is not None:
            rs = apply_rejection_sampling(
                prox, behave, stat_mask, rejection_sampling, cu_seqlens=cu_seqlens
            )
            mask = rs.loss_mask
            weight = rs.behave_imp_weight
            stats["filtered_fraction"] = rs.filtered_fraction
            stats["rs_filtered_fraction"] = rs.filtered_fraction
        else:
            weight = torch.where(
                stat_mask, torch.exp(torch.where(stat_mask, prox - behave, 0.0)), 0.0
            )
        behave_mask = (weight > 0) & mask
        stats["behave_imp_weight"] = weight.detach()
        stats["behave_mask"] = behave_mask
        stats["behave_approx_kl"] = torch.where(behave_mask, prox - behave, 0.0)
        behave_weight = None if decoupled_correction == "none" else weight

    # 3. Ratio (0 off the mask, as AReaL) and surrogate.
    if importance_sampling_level == "sequence":
        log_ratio = torch.where(mask, logprobs - prox, 0.0)
        ratio, adv = sequence_ratio_and_advantages(log_ratio, adv, mask, layout)
        ratio = torch.where(mask, ratio, 0.0)
        adv = torch.where(mask, adv, 0.0)
    else:
        log_ratio = torch.where(stat_mask, logprobs - prox, 0.0)
        ratio = torch.where(stat_mask, torch.exp(log_ratio), 0.0)
    lp = logprobs if surrogate != "cispo" else torch.where(mask, logprobs, 0.0)
    out = surrogate_fn(ratio, adv, lp, params)
    per_token = out.per_token_loss
    if behave_weight is not None:
        per_token = per_token * behave_weight

    # 4. Aggregation over the post-M2PO count (see the docstring).
    n_orig = orig_mask.sum()
    n_stat = stat_mask.sum()
    norm = normalizer
    if m2_threshold is not None and normalizer is not None and int(n_stat) > 0:
        norm = float(normalizer) * int(n_stat) / int(n_orig)

    def agg(values: Tensor, keep: Tensor) -> Tensor:
        return aggregate_loss(  # masks values itself
            values,
            keep,
            loss_agg_mode,
            denominator_mask=stat_mask,
            cu_seqlens=cu_seqlens,
            normalizer=norm,
            constant=loss_agg_norm,
        )

    # 5. On-policy distillation against a teacher (AReaL 2.0 `grpo_loss_fn`).
    if teacher_logprobs is not None:
        teacher = teacher_logprobs.detach()
        if rl_loss_weight == 0:
            old = behave if use_decoupled_loss and behave is not None else prox
            w = torch.exp(torch.where(stat_mask, logprobs - old, 0.0))
            term = w * torch.where(stat_mask, teacher - logprobs.detach(), 0.0)
            loss = -distill_loss_weight * agg(term, stat_mask)
            stats["rkl_loss"] = torch.where(stat_mask, -term.detach(), 0.0)
        else:
            penalty = torch.where(stat_mask, logprobs - teacher, 0.0)
            loss = rl_loss_weight * agg(per_token, mask) + distill_loss_weight * agg(
                penalty, stat_mask
            )
            stats["rkl_loss"] = penalty.detach()
    else:
        loss = agg(per_token, mask)

    clip_over = mask if surrogate == "cispo" else stat_mask  # AReaL's cispo_loss_fn
    stats.update(
        importance_weight=ratio.detach(),
        approx_kl=torch.where(stat_mask, logprobs.detach() - prox, 0.0),
        clip_mask=out.clipped & clip_over,
        dual_clip_mask=out.dual_clipped & stat_mask,
        loss=torch.where(mask, per_token.detach(), 0.0),
        loss_mask=stat_mask,
        actor_loss=scalar(loss),
        **token_counts(n_stat, attention_mask, orig_mask),
    )
    stats.update(out.extra)
    if entropy is not None:
        stats["entropy"] = entropy.detach()
    if versions is not None and current_version is not None:
        gen = orig_mask & (versions >= 0)
        staleness = (current_version - versions).to(torch.float32)
        stats["staleness_avg"] = masked_mean(staleness, gen)
        stats["staleness_min"], stats["staleness_max"] = masked_min_max(staleness, gen)
    return loss, stats


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
    *,
    eps_clip: float | None = 0.5,
    value_loss: str = "mse",
    huber_delta: float = 10.0,
    cu_seqlens: Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | Tensor | None = None,
    loss_agg_norm: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (module docstring) → (scalar loss with grad, stats).

    `eps_clip=None` disables value clipping. `returns` are the GAE critic targets. The
    Huber δ defaults to AReaL's 10 (`ppo_critic_loss_fn`). Stats: AReaL's per-token
    `clip_mask` and `loss`, plus `new_value`, `old_value`, `target_value` and `loss_mask`
    (reported through `stats.CRITIC_TOKEN_STATS`), and the scalars `value_loss`,
    `n_valid_tokens`.
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
    "critic_loss",
    "ppo_actor_loss",
    "sequence_ratio_and_advantages",
    "token_counts",
]
