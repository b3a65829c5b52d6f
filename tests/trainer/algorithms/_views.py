"""The tests' way to the algorithms: settings by field name, through the schema.

`loss_view(**fields)` / `advantage_view(**fields)` validate the fields with
`PPOActorConfig` (and `TeacherConfig` for the distillation weights), so a test uses the
schema's defaults and meets its rules, exactly as the trainer does. `ppo_loss_with(...)`,
`critic_loss_with(...)` and `advantages_with(...)` split a call's keywords into settings and tensors, so the worked cases
read as the formulas they check.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from services.common.config import NormConfig, PPOActorConfig, PPOCriticConfig, TeacherConfig
from services.common.config.views import ActorLossView, AdvantageView, CriticLossView
from services.trainer.algorithms.advantages import AdvantageResult, compute_advantages
from services.trainer.algorithms.losses import critic_loss, ppo_actor_loss
from services.trainer.algorithms.normalization import Level

_TEACHER_FIELDS = ("rl_loss_weight", "distill_loss_weight")


def _actor(fields: dict[str, Any]) -> PPOActorConfig:
    """`PPOActorConfig(**fields)`. `loss_agg_norm` is dropped for the modes that do not read
    it (the schema refuses it there), so one call can sweep every mode."""
    mode = fields.get("loss_agg_mode", PPOActorConfig.model_fields["loss_agg_mode"].default)
    if mode != "seq-mean-token-sum-norm":
        fields.pop("loss_agg_norm", None)
    return PPOActorConfig(**fields)


def _split(kw: dict[str, Any], names: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    settings = {k: v for k, v in kw.items() if k in names}
    return settings, {k: v for k, v in kw.items() if k not in names}


def norm(mean_level: Level, mean_leave1out: bool, std_level: Level, **fields: Any) -> NormConfig:
    """`NormConfig` by AReaL's three leading knobs (the rest: the schema's defaults)."""
    return NormConfig(
        mean_level=mean_level, mean_leave1out=mean_leave1out, std_level=std_level, **fields
    )


def loss_view(*, with_teacher: bool = False, **fields: Any) -> ActorLossView:
    """`ActorLossView` of `PPOActorConfig(**fields)`; the teacher's weights, when given (or
    `with_teacher`), go to a `TeacherConfig`."""
    teacher, actor = _split(fields, _TEACHER_FIELDS)
    with_teacher = with_teacher or bool(teacher)
    return ActorLossView.of(_actor(actor), TeacherConfig(**teacher) if with_teacher else None)


def advantage_view(**fields: Any) -> AdvantageView:
    """`AdvantageView` of `PPOActorConfig(**fields)`."""
    return AdvantageView.of(_actor(fields))


def critic_view(**fields: Any) -> CriticLossView:
    """`CriticLossView` of `PPOCriticConfig` and `PPOActorConfig` (the aggregation)."""
    actor, critic = _split(fields, ("loss_agg_mode", "loss_agg_norm"))
    return CriticLossView.of(PPOCriticConfig(**critic), _actor(actor))


def ppo_loss_with(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    **kw: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`ppo_actor_loss` with the settings among `kw` (actor or teacher field names)."""
    settings, tensors = _split(kw, {*PPOActorConfig.model_fields, *_TEACHER_FIELDS})
    view = loss_view(with_teacher=tensors.get("teacher_logprobs") is not None, **settings)
    return ppo_actor_loss(logprobs, proximal_logprobs, advantages, loss_mask, view, **tensors)


def critic_loss_with(
    values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, **kw: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """`critic_loss` with the settings among `kw` (critic field names, and the actor's
    `loss_agg_mode` / `loss_agg_norm`)."""
    names = {*PPOCriticConfig.model_fields, "loss_agg_mode", "loss_agg_norm"}
    settings, tensors = _split(kw, names)
    return critic_loss(values, old_values, returns, loss_mask, critic_view(**settings), **tensors)


def advantages_with(**kw: Any) -> AdvantageResult:
    """`compute_advantages` with the settings among `kw` (actor field names)."""
    settings, tensors = _split(kw, PPOActorConfig.model_fields)
    return compute_advantages(advantage_view(**settings), **tensors)
