"""The public plugin API: what a user module imports to extend Flywheel.

    from services.api import RewardFn, RolloutWorkflow, WorkflowContext, GroupFilter

Everything a config can name by dotted path has its contract here, with the types those
contracts speak in and the one loader that imports them (`load_dotted`). Every name is
defined in `services.core` (the torch-free ground floor the services share) and only
re-exported here, so this import path stays stable while the services' internals move.
Worked examples of each contract: `docs/extending.md`.
"""

from __future__ import annotations

from services.core.contracts import (
    GaeLambdaFn,
    GroupFilter,
    InferenceEngine,
    RewardFn,
    RewardScorer,
    RewardsFilter,
    RolloutWorkflow,
    Surrogate,
    SurrogateOutput,
    SurrogateParams,
    WorkflowContext,
)
from services.core.filters import is_rewards_filter, rewards_filter, rewards_of
from services.core.plugins import DottedPathError, accepts_positional, load_dotted
from services.core.types import (
    Completion,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    Trajectory,
    TrajectoryGroup,
)

__all__ = [
    "Completion",
    "DottedPathError",
    "GaeLambdaFn",
    "GroupFilter",
    "InferenceEngine",
    "RewardFn",
    "RewardScorer",
    "RewardsFilter",
    "RolloutWorkflow",
    "SamplingParams",
    "ScoreRequest",
    "ScoreResult",
    "Surrogate",
    "SurrogateOutput",
    "SurrogateParams",
    "Trajectory",
    "TrajectoryGroup",
    "WorkflowContext",
    "accepts_positional",
    "is_rewards_filter",
    "load_dotted",
    "rewards_filter",
    "rewards_of",
]
