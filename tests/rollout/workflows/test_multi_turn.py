"""Multi-turn reward discount against AReaL 2.0's `turn_discount` walk
(`InteractionCache.apply_reward_discount`, areal/experimental/openai/cache.py) and its
`MultiTurnWorkflow` (areal/workflow/multi_turn.py), on the real torch engine with a
scripted scorer."""

from __future__ import annotations

import json

import pytest

from services.core.contracts import WorkflowContext
from services.core.types import SamplingParams, ScoreResult
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.workflows.multi_turn import MultiTurnWorkflow, discount_turn_rewards

from .test_workflows import ScriptedScorer, data_row


def test_discount_walk_hand_computed() -> None:
    # AReaL: cur = 0; walking from the last turn to the first, cur = cur * γ + r_i.
    # r = [0.2, 0, 1], γ = 0.5: i=2: 1 ; i=1: 0.5 + 0 = 0.5 ; i=0: 0.25 + 0.2 = 0.45
    assert discount_turn_rewards([0.2, 0.0, 1.0], 0.5) == pytest.approx([0.45, 0.5, 1.0])
    # γ = 1 sums the later rewards: [-1 + 0 + 2, 0 + 2, 2]
    assert discount_turn_rewards([-1.0, 0.0, 2.0], 1.0) == pytest.approx([1.0, 2.0, 2.0])
    # 0/1 rewards: G_0 = γ^{T-1} r_last, AReaL MultiTurnWorkflow's reward * discount
    assert discount_turn_rewards([0.0, 0.0, 0.0, 1.0], 0.9)[0] == pytest.approx(0.9**3)
    assert discount_turn_rewards([], 0.9) == []


async def test_multi_turn_propagates_every_turn_reward(engine: TorchEngine) -> None:
    # Turn scores 0.25, 0.5 (both below the threshold 1), then 1.0; γ = 0.5:
    # G_2 = 1 ; G_1 = 0.5 + 0.5 * 1 = 1.0 ; G_0 = 0.25 + 0.5 * 1.0 = 0.75.
    # (Discounting only the last score would give 1 * 0.5^2 = 0.25.)
    scorer = ScriptedScorer([ScoreResult(0.25), ScoreResult(0.5), ScoreResult(1.0)])
    ctx = WorkflowContext(
        engine.tokenizer,
        SamplingParams(n_samples=1, max_new_tokens=3, ignore_eos=True, seed=5),
        scorer,
    )
    wf = MultiTurnWorkflow(ctx, max_turns=4, turn_discount=0.5, feedback="#")
    group = await wf.arun_episode(engine, data_row(engine))
    assert group is not None
    (t,) = group.trajectories
    assert t.metadata["turns"] == "3"
    assert t.reward == pytest.approx(0.75)
    assert json.loads(t.metadata["turn_rewards"]) == pytest.approx([0.75, 1.0, 1.0])
