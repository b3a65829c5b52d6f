"""Workflow: one turn, with each sample's reward reduced by its length (fewer tokens win)."""

from typing import Any

from services.api import InferenceEngine, ScoreRequest, TrajectoryGroup, WorkflowContext
from services.rollout.workflows.base import build_trajectory, completion_piece, make_group


class LengthPenaltyWorkflow:
    def __init__(self, ctx: WorkflowContext, penalty_per_token: float = 0.001) -> None:
        self.ctx = ctx
        self.penalty = penalty_per_token

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> TrajectoryGroup | None:
        prompt_ids = list(data["prompt_ids"])
        samples = await engine.agenerate_n(prompt_ids, self.ctx.sampling)
        requests = [
            ScoreRequest(c.text, answer=str(data["answer"]), completion_ids=c.output_ids)
            for c in samples
        ]
        scores = await self.ctx.scorer.score(requests)
        if not all(s.ok for s in scores):
            return None  # skip the row: some reward could not be computed
        trajectories = [
            build_trajectory(
                prompt_ids,
                [completion_piece(c)],
                reward=s.reward - self.penalty * len(c.output_ids),
                stop_reason=c.stop_reason,
            )
            for c, s in zip(samples, scores, strict=True)
        ]
        return make_group(trajectories, data)
