"""`NormConfig`: mean/std normalisation of rewards or advantages (`actor.reward_norm`,
`actor.adv_norm`), AReaL's block of the same name and defaults.

One block for both uses, as in AReaL, so that a preset names a normalisation (GRPO's group
mean and std, Dr.GRPO's mean only, RLOO's leave-one-out) the same way wherever it applies.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ._base import FlywheelModel, RuleViolation

NormLevel = Literal["batch", "group"] | None

_NULL_WORDS = {"none", "null", "~"}


class NormConfig(FlywheelModel):
    """Mean/std normalisation of rewards or advantages (`reward_norm`, `adv_norm`)."""

    mean_level: NormLevel = "batch"
    """Where the mean is taken: over the whole batch, within each prompt group, or
    nowhere (null: no centring)."""

    mean_leave1out: bool = False
    """Centre each element on the mean of the *other* elements of its batch/group (RLOO):
    for per-token values one token is left out, not its whole completion."""

    std_level: NormLevel = "batch"
    """Where the standard deviation is taken: batch, group, or null (std 1 and no eps;
    Dr.GRPO removes it to avoid favouring easy/hard prompts). It is taken around the same
    per-element mean that is subtracted (0 when `mean_level` is null)."""

    std_unbiased: bool = True
    """Use the unbiased (n-1) standard deviation; the std of one element is then 1."""

    eps: float = Field(default=1e-5, gt=0.0)
    """Added to the standard deviation before dividing, so constant groups do not explode."""

    group_size: int = Field(default=1, ge=1)
    """Group size used only when the batch carries no group metadata (fallback):
    consecutive runs of `group_size` sequences; rows after the last full group get mean 0
    and std 1."""

    per_completion: bool = False
    """Flywheel: statistics of per-token values count each completion once, through the
    mean of its valid tokens (every completion weighs the same whatever its length).
    false is AReaL's: every valid token counts once, so longer completions weigh more."""

    @model_validator(mode="after")
    def _leave1out_needs_mean(self) -> NormConfig:
        if self.mean_leave1out and self.mean_level is None:
            raise RuleViolation(
                "mean_leave1out",
                True,
                "leave-one-out needs a mean to leave the element out of: set mean_level "
                "to 'batch' or 'group', or mean_leave1out to false",
            )
        return self

    @field_validator("mean_level", "std_level", mode="before")
    @classmethod
    def _level(cls, value: Any, info: Any) -> Any:
        # YAML users write `none`/`None` (AReaL's docs did); treat them as null.
        if isinstance(value, str) and value.strip().lower() in _NULL_WORDS:
            return None
        if value not in ("batch", "group", None):
            raise RuleViolation(
                info.field_name,
                value,
                "normalisation level must be 'batch', 'group' or null (no "
                f"{'centring' if info.field_name == 'mean_level' else 'scaling'})",
            )
        return value

    @property
    def uses_group_statistics(self) -> bool:
        """Whether the mean or the std is taken per prompt group."""
        return self.mean_level == "group" or self.std_level == "group"
