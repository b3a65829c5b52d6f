"""Frozen per-purpose views of the actor config, built once at load for the algorithms.

The schema (`PPOActorConfig`, `TeacherConfig`) validates every value and owns every
default; a view only selects the fields one algorithm reads, resolves the few derived
values (the divisor of `seq-mean-token-sum-norm`), and cannot be changed afterwards. The
algorithms take tensors and one view, and re-check nothing the schema already checked.

* `ActorLossView`: what the actor loss reads (surrogate, clipping, decoupled PPO and its
  π_prox method, off-policy corrections, aggregation, the teacher's loss weights).
* `CriticLossView`: what `critic_loss` reads.
* `AdvantageView`: what the advantages read (reward shaping, the KL reward and which
  π_old it compares, GAE, normalisation).

Importable without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, TypeVar

from .actor import (
    NormConfig,
    PPOActorConfig,
    PPOCriticConfig,
    RejectionSamplingConfig,
    TeacherConfig,
)

V = TypeVar("V")


@dataclass(frozen=True)
class DistillationWeights:
    """On-policy distillation's loss weights (`TeacherConfig`)."""

    rl_loss_weight: float
    distill_loss_weight: float


@dataclass(frozen=True)
class ActorLossView:
    """The actor loss's settings, named as in `PPOActorConfig` (AReaL's names).

    `loss_agg_norm` is resolved: the config's `loss_agg_norm`, else `max_new_tokens` (the
    divisor of `seq-mean-token-sum-norm`). `rejection_sampling` is None without the
    decoupled loss (the schema refuses it there). `distillation` holds the teacher's
    weights when a teacher is configured.
    """

    surrogate: str
    eps_clip: float
    eps_clip_higher: float | None
    c_clip: float | None
    sapo_tau_pos: float
    sapo_tau_neg: float
    importance_sampling_level: str
    use_decoupled_loss: bool
    decoupled_correction: str
    rejection_sampling: RejectionSamplingConfig | None
    m2_threshold: float | None
    loss_agg_mode: str
    loss_agg_norm: float | None
    distillation: DistillationWeights | None
    prox_logp_method: str
    ppo_n_minibatches: int

    @classmethod
    def of(cls, actor: PPOActorConfig, teacher: TeacherConfig | None = None) -> ActorLossView:
        """The view of a validated actor config (and the teacher block, if any)."""
        norm = actor.loss_agg_norm if actor.loss_agg_norm is not None else actor.max_new_tokens
        weights = None
        if teacher is not None:
            weights = DistillationWeights(teacher.rl_loss_weight, teacher.distill_loss_weight)
        return _select(
            cls,
            actor,
            rejection_sampling=actor.rejection_sampling if actor.use_decoupled_loss else None,
            loss_agg_norm=float(norm),
            distillation=weights,
        )


@dataclass(frozen=True)
class CriticLossView:
    """The critic loss's settings (`PPOCriticConfig`), with the aggregation of the actor's
    loss (`ActorLossView`: `loss_agg_mode`, the resolved `loss_agg_norm`)."""

    eps_clip: float
    value_loss: str
    huber_delta: float
    loss_agg_mode: str
    loss_agg_norm: float | None

    @classmethod
    def of(cls, critic: PPOCriticConfig, actor: PPOActorConfig) -> CriticLossView:
        """The view of a validated critic config, aggregated as the actor's loss."""
        actor_view = ActorLossView.of(actor)
        return _select(
            cls,
            critic,
            loss_agg_mode=actor_view.loss_agg_mode,
            loss_agg_norm=actor_view.loss_agg_norm,
        )


@dataclass(frozen=True)
class AdvantageView:
    """The advantage pipeline's settings, named as in `PPOActorConfig` (AReaL's names)."""

    reward_bias: float
    reward_scaling: float
    reward_clip: float
    reward_norm: NormConfig | None
    overlong_reward_penalty: bool
    overlong_tokens: int | None
    overlong_penalty_factor: float | None
    max_new_tokens: int
    mask_no_eos_with_zero: bool
    overlong_filtering: bool
    kl_ctl: float
    kl_estimator: str
    kl_clamp: float | None
    discount: float
    gae_lambda: float | str
    gae_lambda_kwargs: Mapping[str, Any]
    gae_timestep_unit: str
    adv_norm: NormConfig | None
    recompute_logprob: bool
    use_decoupled_loss: bool

    @classmethod
    def of(cls, actor: PPOActorConfig) -> AdvantageView:
        """The view of a validated actor config."""
        return _select(
            cls, actor, gae_lambda_kwargs=MappingProxyType(dict(actor.gae_lambda_kwargs))
        )


def _select(view: type[V], source: Any, **resolved: Any) -> V:
    """`view` with each field read from `source` under the same name, or from `resolved`."""
    return view(
        **{
            f.name: resolved[f.name] if f.name in resolved else getattr(source, f.name)
            for f in fields(view)  # type: ignore[arg-type]
        }
    )


__all__ = ["ActorLossView", "AdvantageView", "CriticLossView", "DistillationWeights"]
