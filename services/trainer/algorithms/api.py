"""The trainer's entry points, one per concept, so a script calls the code the trainer calls.

`PPOTrainer` (`services/trainer/ppo.py`) goes through these functions and nothing else
for its algorithm steps; they take tensors and a frozen view of the config, built once at
load (`services.common.config.views`: `AdvantageView.of(actor)`,
`ActorLossView.of(actor, teacher)`):

* `batch_advantages(settings, batch, ...)`: advantages, returns and the final loss mask of a
  padded batch (`SeqBatch` or anything with its field names), choosing the policy the KL
  reward compares with the reference as AReaL does (`kl_logprobs`).
* `actor_loss(settings, logprobs, advantages, loss_mask, prox_logp_method=..., ...)`: π_prox
  by the chosen method (`recompute`, `loglinear`, `linear`, `metrics`, `reuse_train_logp`,
  `rollout`), then `ppo_actor_loss` with the actor's settings, the teacher term included.
* `gae_lambda_context(loss_mask, turn_ids, gae_timestep_unit)`: what a λ function receives.
* `approximate_prox_logp(method, behave, theta, alpha)`: each proximal approximation
  (`loglinear`, `linear`, `rollout`), with `interpolation_alpha` for α.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from services.common.config.views import ActorLossView, AdvantageView

from .advantages import AdvantageResult, compute_advantages
from .gae_lambda import gae_lambda_context
from .losses import ppo_actor_loss
from .prox import approximate_prox_logp, compute_prox_logp, interpolation_alpha


class BatchLike(Protocol):
    """The fields of `services.trainer.batch.SeqBatch` that advantages need (padded)."""

    @property
    def rewards(self) -> Tensor: ...  # [B]
    @property
    def loss_mask(self) -> Tensor: ...  # [B, T]
    @property
    def no_eos(self) -> Tensor: ...  # [B] bool
    @property
    def behave_logp(self) -> Tensor: ...  # [B, T]
    @property
    def group_index(self) -> Tensor: ...  # [B]
    @property
    def turn_ids(self) -> Tensor | None: ...  # [B, T] or None
    @property
    def attention_mask(self) -> Tensor: ...  # [B, T]


def kl_logprobs(
    settings: AdvantageView, behave_logprobs: Tensor, prox_logprobs: Tensor | None
) -> Tensor:
    """π_old of the KL reward: the behaviour log-probabilities, replaced by the recomputed
    ones only when `recompute_logprob` is on and the decoupled loss is off (AReaL's
    `PPOActor._compute_advantages`, `areal/trainer/ppo/actor.py`)."""
    if prox_logprobs is not None and settings.recompute_logprob and not settings.use_decoupled_loss:
        return prox_logprobs
    return behave_logprobs


def batch_advantages(
    settings: AdvantageView,
    batch: BatchLike,
    *,
    prox_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    values: Tensor | None = None,
    bootstrap_values: Tensor | None = None,
    process_group: Any = None,
) -> AdvantageResult:
    """`compute_advantages` on a padded batch with the actor config's advantage view.

    `prox_logprobs` is the recomputed π (if the trainer ran that forward), `ref_logprobs`
    the reference model's (needed when `kl_ctl > 0`), `values` / `bootstrap_values` the
    critic's. Every tensor is `[B, T]` except `bootstrap_values` `[B]`.
    """
    logprobs = None
    if ref_logprobs is not None:
        logprobs = kl_logprobs(settings, batch.behave_logp, prox_logprobs)
    return compute_advantages(
        settings,
        process_group=process_group,
        rewards=batch.rewards,
        loss_mask=batch.loss_mask.bool(),
        no_eos=batch.no_eos,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        bootstrap_values=bootstrap_values,
        group_ids=batch.group_index,
        turn_ids=batch.turn_ids,
        attention_mask=batch.attention_mask,
    )


def actor_loss(
    settings: ActorLossView,
    logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    behave_logprobs: Tensor,
    prox_logp_method: str | None = None,
    recomputed_logprobs: Tensor | None = None,
    versions: Tensor | None = None,
    current_version: int | None = None,
    theta_version: float | Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    entropy: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor's loss on one micro-batch → (loss with grad, stats), as the trainer does it.

    π_prox: with the decoupled loss, `compute_prox_logp(prox_logp_method, ...)` (default
    `settings.prox_logp_method`; `recomputed_logprobs` is the forward with the step's starting
    weights, needed by `recompute` / `metrics`); without it π_old = `recomputed_logprobs` if
    given, else `behave_logprobs` (and it stands for π_behave too, as in AReaL: M2PO then
    masks nothing), and a `prox_logp_method` is refused. `teacher_logprobs` are weighed by
    the teacher's `rl_loss_weight` / `distill_loss_weight` (`settings.distillation`). `attention_mask` (the micro-batch's, padded layout) makes
    `n_total_tokens` count tokens rather than positions. The stats are `ppo_actor_loss`'s
    plus the proximal method's.
    """
    method = prox_logp_method or settings.prox_logp_method
    extra: dict[str, Tensor] = {}
    if settings.use_decoupled_loss:
        res = compute_prox_logp(
            method,
            theta_logprobs=logprobs.detach(),
            behave_logprobs=behave_logprobs,
            versions=versions,
            current_version=current_version,
            loss_mask=loss_mask,
            recomputed_logprobs=recomputed_logprobs,
            theta_version=theta_version,
            ppo_n_minibatches=settings.ppo_n_minibatches,
        )
        prox = res.prox_logprobs
        extra = res.stats
    else:
        if prox_logp_method is not None:
            raise ValueError(
                f"prox_logp_method={prox_logp_method!r} applies to the decoupled loss only; "
                "set use_decoupled_loss: true (without it π_prox is π_old)"
            )
        prox = recomputed_logprobs if recomputed_logprobs is not None else behave_logprobs
        # AReaL's loss sees one "old" policy here (its `logprobs` input is π_old): M2PO
        # compares it with itself and masks nothing, the teacher weight uses it.
        behave_logprobs = prox
    loss, stats = ppo_actor_loss(
        logprobs,
        prox,
        advantages,
        loss_mask,
        settings,
        behave_logprobs=behave_logprobs,
        teacher_logprobs=teacher_logprobs,
        cu_seqlens=cu_seqlens,
        normalizer=normalizer,
        entropy=entropy,
        versions=versions,
        current_version=current_version,
        attention_mask=attention_mask,
    )
    stats.update(extra)
    return loss, stats


__all__ = [
    "BatchLike",
    "actor_loss",
    "approximate_prox_logp",
    "batch_advantages",
    "gae_lambda_context",
    "interpolation_alpha",
    "kl_logprobs",
]
