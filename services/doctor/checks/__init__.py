"""The checks of `flywheel doctor`: pure functions from a run's evidence to a verdict.

Each check returns pass / warn / fail (or n/a when its input is missing), the numbers it
judged and one line of advice. The thresholds follow AReaL's diagnosis guide where it gives
one (`no_eos_ratio` above 0.05; importance weight exactly 1 with one minibatch; both weights'
means close to 1) and are stated beside each check where it does not;
docs/troubleshooting.md explains each. One module per family: `weights`, `truncation`,
`rewards`, `pipeline`, `vision`, `agents`; `base` holds the result type and the verdict. A new check is a
function of `Evidence` added to `CHECKS`.
"""

from __future__ import annotations

from collections.abc import Callable

from services.doctor.evidence import Evidence

from .agents import agent_episode_failures, template_drift, tool_failures
from .base import SEVERITY, Check, Status, verdict
from .pipeline import (
    BUFFER_DECISIONS,
    FILTERED_FAIL,
    FILTERED_WARN,
    STALE_FAIL,
    STALE_WARN,
    WAIT_WARN,
    dropped_groups,
    restarts,
    staleness,
    starvation,
)
from .rewards import (
    BASELINE_NEAR_ZERO,
    FLAT_MIN_STEPS,
    NOISE_FAIL,
    NOISE_WARN,
    REWARD_FAIL_FAIL,
    REWARD_FAIL_WARN,
    REWARD_SE_WARN,
    TREND_MIN_STEPS,
    TREND_Z,
    reward_failures,
    reward_trend,
    reward_variance,
)
from .truncation import (
    NO_EOS_FAIL,
    NO_EOS_WARN,
    no_eos_ratio,
)
from .vision import IMAGES_WARN, PROCESSOR_WARN_S, processor_time, vision_images
from .weights import (
    BW_FAIL,
    BW_UNCAPPED_MAX,
    BW_WARN,
    IW_EXACT_TOL,
    IW_EXACT_TOL_LOW,
    IW_FAIL,
    IW_WARN,
    RS_FILTERED_WARN,
    behave_imp_weight,
    importance_weight,
    weight_parity,
    weight_sync,
)

CHECKS: tuple[Callable[[Evidence], Check], ...] = (
    importance_weight,
    behave_imp_weight,
    no_eos_ratio,
    reward_variance,
    staleness,
    dropped_groups,
    reward_failures,
    starvation,
    restarts,
    weight_sync,
    weight_parity,
    reward_trend,
    vision_images,
    processor_time,
    template_drift,
    agent_episode_failures,
    tool_failures,
)
"""Every check, in the order the report lists them."""


def run_checks(ev: Evidence) -> list[Check]:
    """Every check's result on `ev`, in `CHECKS` order."""
    return [check(ev) for check in CHECKS]


__all__ = [
    "BASELINE_NEAR_ZERO",
    "BUFFER_DECISIONS",
    "BW_FAIL",
    "BW_UNCAPPED_MAX",
    "BW_WARN",
    "CHECKS",
    "Check",
    "FILTERED_FAIL",
    "FILTERED_WARN",
    "FLAT_MIN_STEPS",
    "IMAGES_WARN",
    "IW_EXACT_TOL",
    "IW_EXACT_TOL_LOW",
    "IW_FAIL",
    "IW_WARN",
    "NOISE_FAIL",
    "NOISE_WARN",
    "NO_EOS_FAIL",
    "NO_EOS_WARN",
    "PROCESSOR_WARN_S",
    "REWARD_FAIL_FAIL",
    "REWARD_FAIL_WARN",
    "REWARD_SE_WARN",
    "RS_FILTERED_WARN",
    "SEVERITY",
    "STALE_FAIL",
    "STALE_WARN",
    "Status",
    "TREND_MIN_STEPS",
    "TREND_Z",
    "WAIT_WARN",
    "agent_episode_failures",
    "behave_imp_weight",
    "dropped_groups",
    "importance_weight",
    "no_eos_ratio",
    "processor_time",
    "restarts",
    "reward_failures",
    "reward_trend",
    "reward_variance",
    "run_checks",
    "staleness",
    "starvation",
    "template_drift",
    "tool_failures",
    "verdict",
    "vision_images",
    "weight_parity",
    "weight_sync",
]
