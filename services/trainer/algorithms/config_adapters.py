"""Thin adapters from the config blocks (`PPOActorConfig`, `PPOCriticConfig`) to the pure
functions, so the trainer passes a config object and tensors, and the mapping from AReaL
field names to keyword arguments lives in one place.

The adapters read attributes only (duck typing): they work with
`services.common.config` models and with any object carrying the same field names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from services.core.contracts import GroupFilter
from services.core.filters import resolve_should_accept

from .advantages import AdvantageResult, compute_advantages
from .kl import KL_CLAMP
from .losses import critic_loss, ppo_actor_loss
from .prox import ProxResult, compute_prox_logp

if TYPE_CHECKING:  # pragma: no cover
    from services.common.config.actor import PPOActorConfig, PPOCriticConfig


def surrogate_name(actor: PPOActorConfig | Any) -> str:
    """The surrogate's registry name or dotted path: `actor.surrogate`, or for an object
    without that field AReaL's booleans (`use_sapo_loss` → `sapo`, `use_cispo_loss` →
    `cispo`, else `clip`). Which combinations are allowed is the config's rule
    (`PPOActorConfig`), checked once at load."""
    name = getattr(actor, "surrogate", None)
    if name:
        return str(name)
    if getattr(actor, "use_cispo_loss", False):
        return "cispo"
    return "sapo" if getattr(actor, "use_sapo_loss", False) else "clip"


def loss_agg_constant(actor: PPOActorConfig | Any) -> float | None:
    """The divisor of `seq-mean-token-sum-norm`: `loss_agg_norm`, else `max_new_tokens`."""
    norm = getattr(actor, "loss_agg_norm", None)
    if norm is not None:
        return float(norm)
    max_new = getattr(actor, "max_new_tokens", None)
    return None if max_new is None else float(max_new)


def advantage_kwargs(actor: PPOActorConfig | Any) -> dict[str, Any]:
    """Keyword arguments of `compute_advantages` from an actor config."""
    return {
        "reward_bias": actor.reward_bias,
        "reward_scaling": actor.reward_scaling,
        "reward_clip": actor.reward_clip,
        "reward_norm": actor.reward_norm,
        "overlong_reward_penalty": actor.overlong_reward_penalty,
        "overlong_tokens": actor.overlong_tokens,
        "overlong_penalty_factor": actor.overlong_penalty_factor,
        "max_new_tokens": actor.max_new_tokens,
        "mask_no_eos_with_zero": actor.mask_no_eos_with_zero,
        "overlong_filtering": getattr(actor, "overlong_filtering", False),
        "kl_ctl": actor.kl_ctl,
        "kl_estimator": actor.kl_estimator,
        "kl_clamp": getattr(actor, "kl_clamp", KL_CLAMP),
        "discount": actor.discount,
        "gae_lambda": actor.gae_lambda,
        "gae_lambda_kwargs": dict(getattr(actor, "gae_lambda_kwargs", {}) or {}),
        "gae_timestep_unit": getattr(actor, "gae_timestep_unit", "token"),
        "adv_norm": actor.adv_norm,
        "group_size": getattr(actor, "group_size", None),
    }


def actor_loss_kwargs(actor: PPOActorConfig | Any) -> dict[str, Any]:
    """Keyword arguments of `ppo_actor_loss` from an actor config."""
    return {
        "surrogate": surrogate_name(actor),
        "eps_clip": actor.eps_clip,
        "eps_clip_higher": actor.eps_clip_higher,
        "c_clip": actor.c_clip,
        "sapo_tau_pos": getattr(actor, "sapo_tau_pos", 1.0),
        "sapo_tau_neg": getattr(actor, "sapo_tau_neg", 1.05),
        "importance_sampling_level": actor.importance_sampling_level,
        "use_decoupled_loss": actor.use_decoupled_loss,
        "decoupled_correction": getattr(actor, "decoupled_correction", "behave_imp_weight"),
        "rejection_sampling": actor.rejection_sampling if actor.use_decoupled_loss else None,
        "m2_threshold": actor.m2_threshold,
        "loss_agg_mode": getattr(actor, "loss_agg_mode", "token-mean"),
        "loss_agg_norm": loss_agg_constant(actor),
    }


def critic_loss_kwargs(
    critic: PPOCriticConfig | Any, actor: PPOActorConfig | Any | None = None
) -> dict[str, Any]:
    """Keyword arguments of `critic_loss` from a critic config (aggregation from the actor)."""
    kwargs: dict[str, Any] = {
        "eps_clip": critic.eps_clip,
        "value_loss": getattr(critic, "value_loss", "mse"),
        "huber_delta": getattr(critic, "huber_delta", 10.0),
    }
    if actor is not None:
        kwargs["loss_agg_mode"] = getattr(actor, "loss_agg_mode", "token-mean")
        kwargs["loss_agg_norm"] = loss_agg_constant(actor)
    return kwargs


def advantages_from_config(
    actor: PPOActorConfig | Any, *, process_group: Any = None, **tensors: Any
) -> AdvantageResult:
    """`compute_advantages(**tensors)` with the actor config's settings."""
    return compute_advantages(**tensors, **advantage_kwargs(actor), process_group=process_group)


def actor_loss_from_config(
    actor: PPOActorConfig | Any,
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    **tensors: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`ppo_actor_loss` with the actor config's settings; `tensors` are the optional
    per-call inputs (`behave_logprobs`, `cu_seqlens`, `normalizer`, `entropy`,
    `versions`, `current_version`)."""
    return ppo_actor_loss(
        logprobs, proximal_logprobs, advantages, loss_mask, **tensors, **actor_loss_kwargs(actor)
    )


def critic_loss_from_config(
    critic: PPOCriticConfig | Any,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    *,
    actor: PPOActorConfig | Any | None = None,
    **tensors: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`critic_loss` with the critic config's settings."""
    return critic_loss(
        values, old_values, returns, loss_mask, **tensors, **critic_loss_kwargs(critic, actor)
    )


def prox_from_config(actor: PPOActorConfig | Any, **tensors: Any) -> ProxResult:
    """`compute_prox_logp(actor.prox_logp_method, ...)`, checking `ppo_n_minibatches`."""
    return compute_prox_logp(
        actor.prox_logp_method, **tensors, ppo_n_minibatches=actor.ppo_n_minibatches
    )


def should_accept_from_config(actor: PPOActorConfig | Any) -> GroupFilter:
    """The group filter (`services.api.GroupFilter`) from `should_accept_fn` /
    `dynamic_sampling`."""
    return resolve_should_accept(
        getattr(actor, "should_accept_fn", None),
        dynamic_sampling=bool(getattr(actor, "dynamic_sampling", False)),
    )
