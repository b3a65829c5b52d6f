"""What every workflow shares: the episode contract, reward scoring, and trajectory building.

A workflow turns one data row into one `TrajectoryGroup` (`n_samples` completions of one
prompt) with `await workflow.arun_episode(engine, data)`, or returns None to skip the row
(e.g. a reward failure under `on_failure: drop_group`). The loop owns ids, reservations and
the buffer; the workflow only generates and scores. A user workflow is any class with that
method, named by dotted path (`my_pkg.my_mod.MyWorkflow`), built as `cls(ctx, **kwargs)`.

The contracts (`RolloutWorkflow`, `WorkflowContext`, `InferenceEngine`, `RewardScorer`) are
defined in `services.core.contracts`, the types (`ScoreRequest`, `ScoreResult`) in
`services.core.types`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from services.core.contracts import RolloutWorkflow, WorkflowContext
from services.core.plugins import load_dotted
from services.core.types import Completion, ScoreRequest, ScoreResult, Trajectory, TrajectoryGroup


class RewardServiceScorer:
    """Scores through the reward service (`services.reward.client.RewardClient`)."""

    def __init__(self, client: Any, *, fn: str = "", deadline_s: float | None = None) -> None:
        self.client = client
        self.fn = fn
        self.deadline_s = deadline_s

    async def score(self, items: Sequence[ScoreRequest]) -> list[ScoreResult]:
        results: list[ScoreResult] = await self.client.score_batch(
            list(items), fn=self.fn, deadline_s=self.deadline_s
        )
        return results


def reward_kwargs(data: Mapping[str, Any]) -> dict[str, Any]:
    """Dataset fields passed to the reward function as keyword arguments (JSON-safe ones)."""
    skip = {"prompt", "answer", "prompt_ids", "prompt_text", "completion", "completions"}
    out: dict[str, Any] = {}
    for k, v in data.items():
        if k in skip:
            continue
        if isinstance(v, str | int | float | bool) or v is None:
            out[k] = v
    return out


def build_trajectory(
    prompt_ids: Sequence[int],
    pieces: Sequence[tuple[Sequence[int], Sequence[float], Sequence[int], int]],
    *,
    reward: float,
    stop_reason: str,
    metadata: Mapping[str, str] | None = None,
    multi_turn: bool = False,
) -> Trajectory:
    """A trajectory from a prompt and pieces `(ids, logprobs, versions, turn)` after it.

    `turn >= 0` marks generated tokens of assistant turn `turn` (loss_mask 1, their logprobs
    and versions); `turn == -1` marks inserted tokens such as feedback (loss_mask 0,
    logprob 0, version -1). Prompt tokens carry version -1, as every consumer expects.
    """
    ids = list(prompt_ids)
    mask = [0] * len(ids)
    lps = [0.0] * len(ids)
    vers = [-1] * len(ids)
    turns = [-1] * len(ids)
    for piece_ids, piece_lps, piece_vers, turn in pieces:
        n = len(piece_ids)
        ids.extend(piece_ids)
        if turn >= 0:
            if len(piece_lps) != n or len(piece_vers) != n:
                raise ValueError("a generated piece needs one logprob and one version per token")
            mask.extend([1] * n)
            lps.extend(piece_lps)
            vers.extend(piece_vers)
        else:
            mask.extend([0] * n)
            lps.extend([0.0] * n)
            vers.extend([-1] * n)
        turns.extend([turn] * n)
    return Trajectory(
        trajectory_id="",
        group_id="",
        input_ids=np.asarray(ids, dtype=np.int64),
        loss_mask=np.asarray(mask, dtype=np.int8),
        logprobs=np.asarray(lps, dtype=np.float32),
        versions=np.asarray(vers, dtype=np.int64),
        reward=float(reward),
        no_eos=stop_reason != "stop",
        prompt_len=len(prompt_ids),
        stop_reason=stop_reason,
        turn_ids=np.asarray(turns, dtype=np.int64) if multi_turn else None,
        metadata=dict(metadata or {}),
    )


def completion_piece(c: Completion, turn: int = 0) -> tuple[list[int], list[float], list[int], int]:
    return (c.output_ids, c.logprobs, c.versions, turn)


def make_group(trajectories: list[Trajectory], data: Mapping[str, Any]) -> TrajectoryGroup:
    return TrajectoryGroup(
        group_id="",
        trajectories=trajectories,
        prompt_id=str(data.get("prompt_id", "")),
        created_unix_ms=int(time.time() * 1000),
    )


BUILTIN_WORKFLOWS = {
    "rlvr": "services.rollout.workflows.rlvr:RLVRWorkflow",
    "multi_turn": "services.rollout.workflows.multi_turn:MultiTurnWorkflow",
    "vision_rlvr": "services.rollout.workflows.vision_rlvr:VisionRLVRWorkflow",
    "agent": "services.rollout.workflows.agent:AgentWorkflow",
}


def resolve_workflow_class(name: str) -> type:
    """The class `rollout.workflow` names: a built-in (`rlvr`, `multi_turn`, `vision_rlvr`) or
    a dotted path
    to a class with `async arun_episode(engine, data)`. Errors name the key and the fix."""
    if name in BUILTIN_WORKFLOWS:
        path = BUILTIN_WORKFLOWS[name]
    elif "." in name or ":" in name:
        path = name
    else:
        raise ValueError(
            f"rollout.workflow={name!r} is unknown; use one of {sorted(BUILTIN_WORKFLOWS)} "
            "or a dotted path"
        )
    cls = load_dotted(path, f"rollout.workflow={name!r} cannot be imported", require_callable=True)
    if not callable(getattr(cls, "arun_episode", None)):
        raise ValueError(f"rollout.workflow={name!r} has no async arun_episode(engine, data)")
    return cls  # type: ignore[no-any-return]


def load_workflow(name: str, ctx: WorkflowContext, **kwargs: Any) -> RolloutWorkflow:
    """A registered workflow (`rlvr`, `multi_turn`, `vision_rlvr`) or a class by dotted path,
    built as
    `cls(ctx, **kwargs)`."""
    workflow = resolve_workflow_class(name)(ctx, **kwargs)
    if not isinstance(workflow, RolloutWorkflow):
        raise ValueError(f"rollout.workflow={name!r} has no async arun_episode(engine, data)")
    return workflow
