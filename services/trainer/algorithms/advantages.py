"""Rewards → advantages: the whole pre-update pipeline in one call.

    r_i   = outcome reward of trajectory i (scalar)
    r_i  += overlong penalty                               (DAPO, optional)
    r_i   = clip((r_i + reward_bias) * reward_scaling, ±reward_clip)
    r_i   = 0 for truncated i when overlong_filtering      (and i leaves the loss)
    r_i   = reward_norm(r_i)        (optional, batch or group; over every sequence but
                                     the truncated ones under overlong_filtering)
    r_i   = 0 for truncated i when mask_no_eos_with_zero   (after reward_norm; i stays
                                     in the loss with its KL rewards, as AReaL)
    kl_t  = -kl_ctl * clamp(KL_est(log π_old(t), log π_ref(t)), ±kl_clamp)
                                                           (k1/k2/k3, optional)
    token rewards: kl_t on every generated token, plus r_i on the last generated token
    A, G  = GAE over tokens (KL inside the recurrence) or over turns (KL added per token,
            outside the recurrence and outside the critic target G)
    A     = adv_norm(A)                                    (optional, batch or group)

"π_old" is whatever log-probabilities the caller passes as `logprobs`. AReaL's rule (and
the trainer's, through `kl_logprobs`): the behaviour policy's, replaced by the recomputed
ones only when `recompute_logprob` is on and the decoupled loss is off. The clamp at
±`kl_clamp` (default 10) is AReaL's `KLEstimator(apply_clamp=True)`.

The outcome reward goes on the last *generated* token (AReaL: on the last token of the
sequence, which a multi-turn trajectory ending in tool tokens does not train on): a
deliberate difference, listed in docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from services.common.config.views import AdvantageView

from .checks import require_finite
from .gae import gae_token_level, gae_turn_level
from .gae_lambda import gae_lambda_context, resolve_gae_lambda
from .kl import kl_reward_estimate
from .layout import (
    check_per_seq,
    check_same_shape,
    layout_of,
    packed_to_padded,
    padded_to_packed,
)
from .normalization import normalize_with
from .rewards import overlong_penalty, shape_rewards
from .stats import masked_mean, scalar


@dataclass
class AdvantageResult:
    """Output of `compute_advantages`; per-token tensors keep the input layout."""

    advantages: Tensor
    returns: Tensor
    loss_mask: Tensor  # bool; truncated sequences removed when overlong_filtering
    kl_rewards: Tensor
    token_rewards: Tensor  # task reward on the last generated token + kl_rewards
    rewards: Tensor  # [B] outcome rewards on the last token: shaped, normalised, zeroed
    gae_lambda: Tensor  # [B]
    stats: dict[str, Tensor] = field(default_factory=dict)


def compute_advantages(
    settings: AdvantageView,
    *,
    rewards: Tensor,
    loss_mask: Tensor,
    no_eos: Tensor,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    values: Tensor | None = None,
    bootstrap_values: Tensor | None = None,
    group_ids: Sequence[Hashable] | Tensor | None = None,
    turn_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    attention_mask: Tensor | None = None,
    process_group: Any = None,
) -> AdvantageResult:
    """Turn outcome rewards into per-token advantages and critic targets.

    `settings` is the actor config's advantage view (`AdvantageView.of(actor)`), validated
    at load.
    Per-token inputs (`loss_mask`, `logprobs`, `ref_logprobs`, `values`, `turn_ids`,
    `attention_mask`) share one layout: padded `[B, T]`, or packed `[N]` with `cu_seqlens`.
    Per-sequence inputs: `rewards` `[B]`, `no_eos` `[B]` (bool, the rollout's truncation
    flag), `group_ids` (`B` ids; groups may be unequal), `bootstrap_values` `[B]` (V of the
    state after the last token, needed when `values` are given and a sequence is
    truncated). `values[t]` is V(s_t), the state in which token t is chosen.
    `process_group` all-reduces batch-level normalisation statistics across ranks.

    Truncated sequences (`no_eos`): `mask_no_eos_with_zero` is AReaL's option (the outcome
    reward set to 0 after `reward_norm`; the tokens stay in the loss with their KL
    rewards); `overlong_filtering` removes them from training (reward 0, out of the
    normalisation statistics and the loss mask). One of the two at most.
    """
    layout = layout_of(loss_mask, cu_seqlens)
    check_same_shape(
        layout,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        turn_ids=turn_ids,
        attention_mask=attention_mask,
    )
    check_per_seq(layout, rewards=rewards, no_eos=no_eos, bootstrap_values=bootstrap_values)
    if settings.gae_timestep_unit == "turn" and turn_ids is None:
        raise ValueError(
            "gae_timestep_unit='turn' needs turn_ids (one id per token, -1 outside turns)"
        )
    if settings.kl_ctl > 0 and (logprobs is None or ref_logprobs is None):
        raise ValueError(
            f"kl_ctl={settings.kl_ctl} needs both logprobs and ref_logprobs (a reference model); "
            "set kl_ctl=0 to train without the KL penalty"
        )
    if bootstrap_values is not None and values is None:
        raise ValueError("bootstrap_values were given without values (a critic)")

    if layout.packed:
        cu = layout.cu_seqlens
        assert cu is not None
        lengths = cu[1:] - cu[:-1]

        def pad(t: Tensor | None, fill: float | int | bool = 0) -> Tensor | None:
            return None if t is None else packed_to_padded(t, cu, fill)

        padded = _compute_padded(
            rewards=rewards,
            mask=packed_to_padded(loss_mask.to(torch.bool), cu, False),
            no_eos=no_eos,
            logprobs=pad(logprobs),
            ref_logprobs=pad(ref_logprobs),
            values=pad(values),
            bootstrap_values=bootstrap_values,
            group_ids=group_ids,
            turn_ids=pad(turn_ids, -1),
            seq_lens=lengths,
            settings=settings,
            process_group=process_group,
        )

        def unpad(t: Tensor) -> Tensor:
            return padded_to_packed(t, lengths)[0]

        padded.advantages = unpad(padded.advantages)
        padded.returns = unpad(padded.returns)
        padded.loss_mask = unpad(padded.loss_mask)
        padded.kl_rewards = unpad(padded.kl_rewards)
        padded.token_rewards = unpad(padded.token_rewards)
        return padded

    seq_lens = None if attention_mask is None else attention_mask.to(torch.int64).sum(-1)
    return _compute_padded(
        rewards=rewards,
        mask=loss_mask.to(torch.bool),
        no_eos=no_eos,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        bootstrap_values=bootstrap_values,
        group_ids=group_ids,
        turn_ids=turn_ids,
        seq_lens=seq_lens,
        settings=settings,
        process_group=process_group,
    )


def _compute_padded(
    *,
    rewards: Tensor,
    mask: Tensor,
    no_eos: Tensor,
    logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    values: Tensor | None,
    bootstrap_values: Tensor | None,
    group_ids: Sequence[Hashable] | Tensor | None,
    turn_ids: Tensor | None,
    seq_lens: Tensor | None,
    settings: AdvantageView,
    process_group: Any,
) -> AdvantageResult:
    device = mask.device
    n, t_len = mask.shape
    no_eos = no_eos.to(device=device, dtype=torch.bool)
    raw = rewards.to(device=device, dtype=torch.float32)
    require_finite(torch.ones_like(raw, dtype=torch.bool), "sequences", rewards=raw)
    response_lens = mask.sum(dim=1)
    stats: dict[str, Tensor] = {}

    # 1. Scalar reward shaping.
    r = raw
    if settings.overlong_reward_penalty:
        assert settings.overlong_tokens is not None  # the schema requires both with the
        assert settings.overlong_penalty_factor is not None  # penalty on
        penalty = overlong_penalty(
            response_lens,
            max_new_tokens=settings.max_new_tokens,
            overlong_tokens=settings.overlong_tokens,
            overlong_penalty_factor=settings.overlong_penalty_factor,
        )
        r = r + penalty
        stats["overlong_penalty"] = scalar(penalty.mean() if n else 0.0)
    r = shape_rewards(
        r,
        reward_bias=settings.reward_bias,
        reward_scaling=settings.reward_scaling,
        reward_clip=settings.reward_clip,
    )
    if settings.overlong_filtering:
        r = torch.where(no_eos, 0.0, r)
        mask = mask & ~no_eos.unsqueeze(1)
    seq_valid = mask.any(dim=1)
    # AReaL normalises every sequence's reward (an empty completion's too); only the
    # truncated ones that overlong_filtering removes from training are left out.
    in_norm = ~no_eos if settings.overlong_filtering else torch.ones_like(no_eos)
    r = normalize_with(
        r, settings.reward_norm, in_norm, group_ids=group_ids, process_group=process_group
    )
    if settings.mask_no_eos_with_zero:
        # AReaL 2.0 `PPOActor._compute_advantages`: after reward_norm, the truncated
        # sequence's outcome reward is 0; its tokens keep the loss and the KL reward.
        r = torch.where(no_eos, 0.0, r)

    # 2. Per-token rewards: KL penalty on every generated token, outcome on the last one.
    if settings.kl_ctl > 0:
        assert logprobs is not None and ref_logprobs is not None
        require_finite(mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
        kl = kl_reward_estimate(
            logprobs.detach(), ref_logprobs.detach(), settings.kl_estimator, clamp=settings.kl_clamp
        )
        kl_rewards = torch.where(mask, -settings.kl_ctl * kl, 0.0)
    else:
        kl_rewards = torch.zeros(n, t_len, dtype=torch.float32, device=device)
    pos = torch.arange(t_len, device=device).expand(n, t_len)
    last_pos = torch.where(mask, pos, -1).max(dim=1).values if t_len else torch.full((n,), -1)
    task_rewards = torch.zeros(n, t_len, dtype=torch.float32, device=device)
    has = last_pos >= 0
    task_rewards[torch.arange(n, device=device)[has], last_pos[has]] = r[has]

    # 3. λ per trajectory.
    lam = resolve_gae_lambda(
        settings.gae_lambda,
        gae_lambda_context(mask, turn_ids, settings.gae_timestep_unit),
        settings.gae_lambda_kwargs,
    )

    # 4. GAE.
    bootstrap = None
    if values is not None:
        require_finite(mask, values=values)
        if bool((no_eos & seq_valid).any()):
            if bootstrap_values is None:
                raise ValueError(
                    "bootstrap_values (V of the state after the last token) are required when "
                    "values are given and a sequence is truncated (no_eos)"
                )
            bootstrap = torch.where(no_eos, bootstrap_values.detach().to(torch.float32), 0.0)
    if settings.gae_timestep_unit == "token":
        adv, returns = gae_token_level(
            task_rewards + kl_rewards,
            mask,
            discount=settings.discount,
            gae_lambda=lam,
            values=values,
            bootstrap=bootstrap,
        )
    else:
        assert turn_ids is not None
        adv, returns = gae_turn_level(
            task_rewards,
            mask,
            turn_ids,
            discount=settings.discount,
            gae_lambda=lam,
            values=values,
            bootstrap=bootstrap,
        )
        adv = adv + kl_rewards

    # 5. Advantage normalisation.
    adv = normalize_with(
        adv, settings.adv_norm, mask, group_ids=group_ids, process_group=process_group
    )

    stats.update(
        n_seqs=scalar(n),
        n_valid_tokens=scalar(mask.sum()),
        task_reward=scalar(raw.mean() if n else 0.0),
        correct_n_seqs=scalar((raw > 0).sum()),
        incorrect_n_seqs=scalar((raw <= 0).sum()),
        no_eos_ratio=scalar(no_eos.float().mean() if n else 0.0),
        response_len=scalar(response_lens.float().mean() if n else 0.0),
        shaped_reward=masked_mean(r, seq_valid),
        kl_rewards=masked_mean(kl_rewards, mask),
        advantages=masked_mean(adv, mask),
        advantages_abs=masked_mean(adv.abs(), mask),
        returns=masked_mean(returns, mask),
        gae_lambda=scalar(lam.mean() if n else 0.0),
    )
    if seq_lens is not None:
        seq_lens = seq_lens.to(device=device, dtype=torch.float32)
        stats["seq_len"] = scalar(seq_lens.mean() if n else 0.0)
        stats["prompt_len"] = scalar((seq_lens - response_lens).mean() if n else 0.0)
    return AdvantageResult(
        advantages=adv,
        returns=returns,
        loss_mask=mask,
        kl_rewards=kl_rewards,
        token_rewards=task_rewards + kl_rewards,
        rewards=r,
        gae_lambda=lam,
        stats=stats,
    )
