"""Workflows: how a data row becomes a scored, version-tagged trajectory group."""

from services.rollout.workflows.base import (
    RewardScorer,
    RewardServiceScorer,
    RolloutWorkflow,
    ScoreRequest,
    ScoreResult,
    WorkflowContext,
    build_trajectory,
    load_workflow,
)

__all__ = [
    "RewardScorer",
    "RewardServiceScorer",
    "RolloutWorkflow",
    "ScoreRequest",
    "ScoreResult",
    "WorkflowContext",
    "build_trajectory",
    "load_workflow",
]
