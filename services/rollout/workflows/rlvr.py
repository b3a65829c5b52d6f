"""RLVR: one turn. Generate `n_samples` completions of a prompt, score them as a group."""

from __future__ import annotations

from typing import Any

from services.core.contracts import InferenceEngine, WorkflowContext
from services.core.types import Completion, ScoreRequest, TrajectoryGroup
from services.rollout.workflows.base import (
    build_trajectory,
    completion_piece,
    make_group,
    reward_kwargs,
)


class RLVRWorkflow:
    """Reinforcement learning from verifiable rewards, single turn (AReaL's `RLVRWorkflow`).

    Every sample of the group is scored by the reward function on its decoded text with
    the row's `answer`. A failed score follows `reward.on_failure`: `zero` keeps the sample
    with reward 0 (status recorded in metadata), `drop_group` skips the whole row.
    """

    def __init__(self, ctx: WorkflowContext, **kwargs: Any) -> None:
        if kwargs:
            raise ValueError(f"rlvr workflow takes no workflow_kwargs, got {sorted(kwargs)}")
        self.ctx = ctx

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> TrajectoryGroup | None:
        prompt_ids = list(data["prompt_ids"])
        completions = await engine.agenerate_n(prompt_ids, self.ctx.sampling)
        prompt_text = str(data.get("prompt_text", data.get("prompt", "")))
        return await self.score_group(prompt_ids, prompt_text, completions, data)

    async def score_group(
        self,
        prompt_ids: list[int],
        prompt_text: str,
        completions: list[Completion],
        data: dict[str, Any],
    ) -> TrajectoryGroup | None:
        """The group of one prompt's completions, each scored by the reward function (None:
        dropped under `on_failure: drop_group`)."""
        kwargs = reward_kwargs(data)
        scores = await self.ctx.scorer.score(
            [
                ScoreRequest(
                    completion=c.text,
                    answer=str(data.get("answer", "")),
                    prompt=prompt_text,
                    prompt_ids=prompt_ids,
                    completion_ids=c.output_ids,
                    kwargs=kwargs,
                )
                for c in completions
            ]
        )
        for s in scores:
            if not s.ok:
                self.ctx.on_reward_failure(s.status)
        if self.ctx.on_failure == "drop_group" and not all(s.ok for s in scores):
            return None
        trajectories = [
            build_trajectory(
                prompt_ids,
                [completion_piece(c)],
                reward=s.reward if s.ok else 0.0,
                stop_reason=c.stop_reason,
                metadata={
                    "reward_status": s.status,
                    **({"reward_error": s.message} if s.message else {}),
                },
            )
            for c, s in zip(completions, scores, strict=True)
        ]
        return make_group(trajectories, data)
