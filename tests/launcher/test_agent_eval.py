"""The launcher's held-out evaluation of an agent run: the agent itself, as an outside
client of a real replica API (tiny model, real uvicorn on loopback), on the evaluator's own
loop; tool calls run in the real sandbox."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.common.config import FlywheelConfig
from services.launcher.agent_eval import AgentEvaluator
from services.rollout.engine.torch_engine import TorchEngine
from tests.fixtures_models import tiny_model_dir  # noqa: F401 - fixture
from tests.launcher import eval_agents
from tests.rollout.openai_api.conftest import TOKEN, Served, serve

AGENT = "tests.launcher.eval_agents:by_row"

ROWS = [
    {"prompt": "a", "tool": "12 * 3", "reward": 1},  # right, with a good tool call
    {"prompt": "b", "tool": "bad", "reward": 0},  # wrong, its tool call failed
    {"prompt": "c", "reward": 1},  # right without the tool
    {"prompt": "d", "reward": 0.5},  # partly right: not counted as accurate
    {"prompt": "e", "raise": True, "reward": 1},  # the agent raised
    {"prompt": "f", "reward": "none"},  # no reward to count
]


@pytest.fixture
async def replica(tiny_model_dir: Path) -> AsyncIterator[Served]:  # noqa: F811
    engine = TorchEngine(tiny_model_dir, max_batch_size=4, device="cpu")
    await engine.start()
    try:
        for served in serve(engine):
            yield served
    finally:
        await engine.stop()


@pytest.fixture
def evaluator(monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentEvaluator]:
    """A fresh evaluator, and a fresh sandbox for its loop (as in a new launcher)."""
    monkeypatch.setattr(eval_agents, "_sandbox", None)
    ev = AgentEvaluator()
    yield ev
    if eval_agents._sandbox is not None:  # its workers' pipes belong to the evaluator's loop
        asyncio.run_coroutine_threadsafe(eval_agents._sandbox.close(), ev.loop).result()
    ev.close()


async def test_counts_rewards_tools_failures_and_versions(
    replica: Served, evaluator: AgentEvaluator
) -> None:
    # The evaluator blocks its caller, so it runs off the loop that serves the engine.
    res = await asyncio.to_thread(
        evaluator.evaluate, [replica.url], AGENT, ROWS, auth_token=TOKEN, concurrency=3
    )
    assert res.n == 6
    assert res.accuracy == pytest.approx(2 / 6)
    assert res.mean_reward == pytest.approx(2.5 / 6)
    assert res.tool_call_rate == pytest.approx(2 / 6)
    assert res.tool_calls == 2
    assert res.tool_success_rate == pytest.approx(0.5)
    assert res.failures == 2
    assert res.failure_reasons == {"ValueError": 1, "bad_reward": 1}
    assert (res.version_min, res.version) == (0, 0)  # the engine's first weights
    assert len(replica.store) == 0  # every session closed, the failed ones too
    record = res.record()
    assert record["tool_call_rate"] == res.tool_call_rate
    assert "tool success 0.500" in res.describe_tools()


async def test_runs_again_on_the_same_loop(replica: Served, evaluator: AgentEvaluator) -> None:
    """A second evaluation reuses the agent's sandbox, which belongs to the first's loop."""
    rows = [ROWS[0]] * 2
    for _ in range(2):
        res = await asyncio.to_thread(
            evaluator.evaluate, [replica.url], AGENT, rows, auth_token=TOKEN
        )
        assert (res.accuracy, res.tool_success_rate) == (1.0, 1.0)


async def test_a_refused_token_fails_the_evaluation(
    replica: Served, evaluator: AgentEvaluator
) -> None:
    with pytest.raises(RuntimeError, match="agent evaluation failed"):
        await asyncio.to_thread(
            evaluator.evaluate, [replica.url], AGENT, ROWS[:1], auth_token="wrong"
        )


def test_evaluate_run_addresses_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = FlywheelConfig.model_validate(
        {
            "rollout": {
                "n_replicas": 2,
                "workflow": "agent",
                "agent": {"path": AGENT},
                "max_concurrent_rollouts": 4,
            },
            "services": {"rollout": {"port": 7000, "metrics_port": 7100}},
        }
    )
    seen: dict[str, object] = {}

    def fake(urls: list[str], path: str, rows: list[dict], **kw: object) -> str:
        seen.update(urls=urls, path=path, kw=kw)
        return "result"

    ev = AgentEvaluator()
    try:
        monkeypatch.setattr(ev, "evaluate", fake)
        assert ev.evaluate_run(cfg, ROWS, "tok") == "result"  # type: ignore[comparison-overlap]
    finally:
        ev.close()
    assert seen["urls"] == ["http://127.0.0.1:7100", "http://127.0.0.1:7101"]
    assert seen["path"] == AGENT
    assert seen["kw"] == {
        "auth_token": "tok",
        "episode_timeout": cfg.rollout.agent.episode_timeout,
        "concurrency": 4,  # as many episodes at once as the rollout runs
    }
