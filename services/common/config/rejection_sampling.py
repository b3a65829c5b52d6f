"""`RejectionSamplingConfig`: which tokens or sequences the off-policy correction masks or
clamps (`actor.rejection_sampling`), AReaL's block of the same name and defaults.

Apart from the actor's block because it replaces several older keys (`behave_imp_weight_cap`,
`behave_imp_weight_mode`) whose migration message the actor and the teacher both give.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

from pydantic import model_validator

from ._base import FlywheelModel, RuleViolation

REJECTION_SAMPLING_MIGRATION = (
    "AReaL removed this key and Flywheel does not accept it; express the same filter "
    "with `actor.rejection_sampling` (requires use_decoupled_loss: true). The old default "
    "behave_imp_weight_cap=5 with token_mask is:\n"
    "      rejection_sampling: {level: token, action: mask, metric: ratio, upper: 5.0}\n"
    "    and *_truncate modes become action: clamp; sequence_* modes become level: sequence"
)


class RejectionSamplingConfig(FlywheelModel):
    """Filter or truncate tokens whose behaviour policy is too far from π_prox.

    IcePop is `metric: ratio` with `lower`/`upper` around 1; KPop is `metric: binary_kl`.
    Only used with `use_decoupled_loss: true` (it acts on π_prox/π_behave).
    """

    level: Literal["token", "sequence"] = "token"
    """Judge each token alone, or whole sequences (all tokens share the verdict; with
    `metric: ratio` the correction weight is then the sequence geometric mean)."""

    action: Literal["mask", "clamp"] = "mask"
    """`mask`: drop offending tokens/sequences from the loss; `clamp`: keep them with the
    importance weight clamped to [lower, upper] (ratio metric only)."""

    metric: Literal["ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl"] = "ratio"
    """Divergence compared with the bounds: the ratio π_prox/π_behave, the k1/k2/k3 KL
    estimators of log r, or the symmetric binary KL between the two token probabilities
    (KPop)."""

    agg: Literal["sum", "mean", "max"] = "mean"
    """Aggregation over a sequence's tokens when `level: sequence` (log space for ratio)."""

    upper: float = 5.0
    """Upper bound: larger metric values are rejected (ratio: > 1; KL: >= 0)."""

    lower: float | None = None
    """Optional lower bound (ratio: in (0, 1)); `clamp` uses 0 when unset."""

    @model_validator(mode="after")
    def _bounds(self) -> RejectionSamplingConfig:
        if not math.isfinite(self.upper):
            raise RuleViolation("upper", self.upper, "must be a finite number")
        if self.lower is not None and self.lower > self.upper:
            raise RuleViolation(
                "lower",
                self.lower,
                f"lower bound exceeds upper={self.upper}; set lower <= upper",
            )
        if self.metric == "ratio":
            if self.upper <= 1.0:
                raise RuleViolation(
                    "upper",
                    self.upper,
                    "with metric 'ratio' the upper bound must be > 1 (at <= 1 every token "
                    "whose policy moved at all is rejected); typical values are 2 or 5",
                )
            if self.lower is not None and not (0.0 <= self.lower < 1.0):
                raise RuleViolation(
                    "lower",
                    self.lower,
                    "with metric 'ratio' the lower bound must be in [0, 1) (a ratio is "
                    "positive and 1 means no change); typical value 0.5",
                )
            if self.lower == 0.0 and self.action == "mask":
                raise RuleViolation(
                    "lower",
                    self.lower,
                    "a ratio is always > 0, so lower=0 masks nothing; use a positive "
                    "lower bound or leave it null",
                )
        elif self.metric in ("kl_k2", "kl_k3", "binary_kl") and self.upper <= 0.0:
            raise RuleViolation(
                "upper",
                self.upper,
                f"metric '{self.metric}' is never negative, so the upper bound must be "
                "> 0; typical values are 0.5 to 2",
            )
        if self.action == "clamp":
            if self.metric != "ratio":
                raise RuleViolation(
                    "action",
                    self.action,
                    f"'clamp' truncates the importance ratio and only works with "
                    f"metric 'ratio' (got metric '{self.metric}'); use action: mask",
                )
            if self.lower is None:
                # Truncation keeps every token; an unset lower bound means "no floor".
                self.__dict__["lower"] = 0.0
        if self.level == "token" and self.agg != "mean":
            warnings.warn(
                f"rejection_sampling.agg={self.agg!r} has no effect with level 'token'",
                UserWarning,
                stacklevel=2,
            )
        return self
