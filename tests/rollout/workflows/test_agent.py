"""The agent workflow (`services/rollout/workflows/agent.py`) on the real torch engine: user
agents written with the official `openai` client, run through the replica's OpenAI API in
process; groups in both of AReaL's export styles; failures that stay in their episode."""

from __future__ import annotations

from typing import Any

import pytest

from services.common.config.agent import AgentConfig
from services.core.contracts import WorkflowContext
from services.core.types import SamplingParams, ScoreResult
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.metrics import RolloutMetrics
from services.rollout.workflows.agent import AgentWorkflow
from services.rollout.workflows.base import load_workflow
from tests.rollout.workflows import agents

from .test_workflows import ScriptedScorer, data_row

AGENTS = "tests.rollout.workflows.agents"


def workflow(
    engine: TorchEngine,
    name: str,
    *,
    n: int = 2,
    scorer: ScriptedScorer | None = None,
    metrics: RolloutMetrics | None = None,
    **agent: Any,
) -> AgentWorkflow:
    ctx = WorkflowContext(
        engine.tokenizer,
        SamplingParams(n_samples=n, max_new_tokens=4, seed=3),
        scorer or ScriptedScorer([]),
    )
    wf = load_workflow(
        "agent",
        ctx,
        agent=AgentConfig(path=f"{AGENTS}:{name}", **agent),
        model_name="policy",
        metrics=(metrics or RolloutMetrics()).agent,
    )
    assert isinstance(wf, AgentWorkflow)
    return wf


def failures(metrics: RolloutMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "flywheel_rollout_agent_episode_failures_total", {"reason": reason}
    )
    return value or 0.0


async def test_concat_group_holds_exactly_the_sampled_tokens(engine: TorchEngine) -> None:
    agents.CALLS.clear()
    metrics = RolloutMetrics()
    wf = workflow(engine, "two_turns", n=1, export_style="concat", metrics=metrics)
    group = await wf.arun_episode(engine, data_row(engine))
    assert group is not None and len(group.trajectories) == 1
    (traj,) = group.trajectories
    first, second = agents.CALLS
    assert traj.reward == 1.0
    assert traj.metadata["turns"] == "2" and traj.metadata["reward_source"] == "agent"
    # The official client's usage counts are the reference for what was sampled per turn,
    # and for the prompt the replica rendered last (the whole conversation but the answer).
    assert int((traj.turn_ids == 0).sum()) == first.usage.completion_tokens
    assert int((traj.turn_ids == 1).sum()) == second.usage.completion_tokens
    assert (
        int(traj.loss_mask.sum()) == first.usage.completion_tokens + second.usage.completion_tokens
    )
    assert traj.num_tokens == second.usage.prompt_tokens + second.usage.completion_tokens
    assert traj.prompt_len == first.usage.prompt_tokens
    assert (traj.versions[traj.loss_mask == 1] == engine.version).all()
    assert (traj.versions[traj.loss_mask == 0] == -1).all()
    assert metrics.registry.get_sample_value("flywheel_rollout_agent_episodes_total") == 1
    assert metrics.registry.get_sample_value("flywheel_rollout_agent_turns_total") == 2


async def test_individual_style_gives_each_call_the_discounted_reward(engine: TorchEngine) -> None:
    wf = workflow(engine, "two_turns", n=1, export_style="individual")
    wf.turn_discount = 0.5
    group = await wf.arun_episode(engine, data_row(engine))
    assert group is not None
    # AReaL's walk from the last call: G_1 = 1, G_0 = 0.5 * 1 + 0.
    assert [t.reward for t in group.trajectories] == [0.5, 1.0]
    first, second = group.trajectories
    # The second call's prompt starts with the first call's prompt + output (no drift).
    assert second.input_ids[: first.num_tokens].tolist() == first.input_ids.tolist()


async def test_a_dict_reward_keeps_its_numbers_and_none_asks_the_scorer(
    engine: TorchEngine,
) -> None:
    group = await workflow(engine, "info_dict", n=1).arun_episode(engine, data_row(engine))
    assert group is not None
    (traj,) = group.trajectories
    assert traj.reward == 0.5 and traj.metadata["agent_info"] == '{"tool_calls": 2.0}'
    scorer = ScriptedScorer([ScoreResult(0.75)])
    scored = await workflow(engine, "unscored", n=1, scorer=scorer).arun_episode(
        engine, data_row(engine)
    )
    assert scored is not None and scored.trajectories[0].reward == 0.75
    assert scored.trajectories[0].metadata["reward_source"] == "reward_service"
    assert scorer.seen[0].answer == "#### 46"
    assert (
        scorer.seen[0].completion_ids
        == scored.trajectories[0].input_ids[scored.trajectories[0].prompt_len :].tolist()
    )


async def test_areal_style_agent_classes_get_base_url_and_client(engine: TorchEngine) -> None:
    group = await workflow(engine, "ArealStyle", n=1).arun_episode(engine, data_row(engine))
    assert group is not None and group.trajectories[0].reward == 0.25


async def test_a_raising_episode_is_dropped_and_the_group_goes_on(engine: TorchEngine) -> None:
    metrics = RolloutMetrics()
    wf = workflow(engine, "every_other_raises", n=4, metrics=metrics)
    group = await wf.arun_episode(engine, data_row(engine))
    assert group is not None and len(group.trajectories) == 2
    assert failures(metrics, "error") == 2
    assert (
        await workflow(engine, "raises", metrics=metrics).arun_episode(engine, data_row(engine))
        is None
    )  # every episode failed: the row is skipped
    assert failures(metrics, "error") == 4


@pytest.mark.parametrize(
    ("agent", "limits", "reason"),
    [
        ("hangs", {"episode_timeout": 1.0}, "timeout"),
        ("talks_forever", {"max_turns": 3}, "max_turns"),
        ("talks_forever", {"max_tokens_per_episode": 6}, "token_budget"),
        ("returns_text", {}, "bad_reward"),
        ("raises", {}, "error"),
    ],
)
async def test_an_agent_over_its_limits_fails_only_its_episode(
    engine: TorchEngine, agent: str, limits: dict[str, Any], reason: str
) -> None:
    metrics = RolloutMetrics()
    wf = workflow(engine, agent, n=1, metrics=metrics, **limits)
    assert await wf.arun_episode(engine, data_row(engine)) is None
    assert failures(metrics, reason) == 1
    assert len(wf.sessions) == 0  # the episode's session is closed either way
    # The workflow still serves the next row.
    ok = await workflow(engine, "info_dict", n=1).arun_episode(engine, data_row(engine))
    assert ok is not None


async def test_the_token_budget_caps_each_call(engine: TorchEngine) -> None:
    agents.CALLS.clear()
    wf = workflow(engine, "talks_forever", n=1, max_tokens_per_episode=6)
    await wf.arun_episode(engine, data_row(engine))
    assert sum(c.usage.completion_tokens for c in agents.CALLS) <= 6
