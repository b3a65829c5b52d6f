"""Workflows: how a data row becomes a scored, version-tagged trajectory group."""

from services.rollout.workflows.base import RewardServiceScorer, build_trajectory, load_workflow

__all__ = ["RewardServiceScorer", "build_trajectory", "load_workflow"]
