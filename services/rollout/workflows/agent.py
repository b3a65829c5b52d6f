"""The agent workflow: the user's OpenAI-client agent, `n_samples` episodes per prompt.

A user writes `async def run(client: openai.AsyncOpenAI, data: dict) -> float | dict |
None` (or a class with AReaL 2.0's `async def run(self, data, **extra_kwargs)`, given
`base_url`, `http_client` and `api_key`) and names it in `rollout.agent.path`. Each
episode opens a fresh session on the replica's session store and hands the agent a
client bound to it (`agent_client.py`): every model call is recorded token for token, and
the trajectory is assembled from exactly those tokens (`openai_api.sessions`), in AReaL's
`individual` or `concat` export style.

The reward is what the agent returns: a number, or a dict with a `reward` entry (its other
scalar entries land in the trajectory's metadata). When it returns None the reward
service scores the last answer against the row's `answer` (`ctx.scorer`, `reward.fn`).

Failure is per episode. An agent that raises, passes `episode_timeout`, makes more than
`max_turns` model calls, asks with its token budget spent, makes no model call, or
returns something that is not a reward fails only its episode: the episode is dropped
from the group and its reason counted (`flywheel_rollout_agent_episode_failures_total`).
The rest of the group is kept, as AReaL's `GroupedRolloutWorkflow` keeps the episodes
that returned; a group whose episodes all failed is skipped (the loop counts it as
`workflow_skipped`). A reward-service failure follows `reward.on_failure` as elsewhere:
`zero`, or `drop_group`, which drops the whole group.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import numbers
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import openai

from services.common.config.agent import AgentConfig
from services.core.contracts import InferenceEngine, WorkflowContext
from services.core.plugins import load_dotted
from services.core.tool_events import set_tool_listener
from services.core.turn_discount import discount_turn_rewards
from services.core.types import ScoreRequest, Trajectory, TrajectoryGroup
from services.rollout.openai_api.app import build_openai_app
from services.rollout.openai_api.bridge import EngineBridge
from services.rollout.openai_api.generation import ApiContext
from services.rollout.openai_api.sessions import (
    Session,
    SessionStore,
    export_concat,
    export_individual,
)
from services.rollout.workflows.agent_client import (
    BudgetExceeded,
    EpisodeBudget,
    episode_http_client,
    session_base_url,
)
from services.rollout.workflows.base import make_group, reward_kwargs

log = logging.getLogger(__name__)

IN_PROCESS_KEY = "in-process"
"""The API key the in-process client sends (the in-process app has no guard)."""


class AgentFailure(Exception):
    """An episode failed; `reason` is the metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Episode:
    """What one finished episode left: its session, reward and counts."""

    session: Session
    reward: float
    source: str  # agent | reward_service
    seconds: float
    tools: Counter[tuple[str, str]] = field(default_factory=Counter)
    info: dict[str, float] = field(default_factory=dict)


def load_agent(path: str) -> Any:
    """The agent at `path`: an async function `run(client, data)`, or an AReaL-style class
    whose instances have `async run(data, **extra_kwargs)` (instantiated once here)."""
    target = load_dotted(path, "rollout.agent.path", require_callable=True)
    if inspect.isclass(target):
        target = target()
        if not inspect.iscoroutinefunction(getattr(target, "run", None)):
            raise ValueError(f"rollout.agent.path={path!r}: its class needs `async def run`")
        return target
    if not inspect.iscoroutinefunction(target):
        raise ValueError(f"rollout.agent.path={path!r} is not an `async def` function")
    return target


def as_agent_reward(value: Any) -> tuple[float | None, dict[str, float]]:
    """What the agent returned as (reward or None, scalar extras); `AgentFailure` when it
    is neither a finite number, a dict with one, nor None."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        extras = {
            str(k): float(v)
            for k, v in value.items()
            if k != "reward" and isinstance(v, numbers.Real) and math.isfinite(float(v))
        }
        if "reward" not in value:
            raise AgentFailure("bad_reward", "the agent's dict has no 'reward' entry")
        value = value["reward"]
    if value is None:
        return None, extras
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise AgentFailure("bad_reward", f"the agent returned {value!r}, not a finite reward")
    return float(value), extras


class AgentWorkflow:
    """`rollout.workflow: agent`: `rollout.agent.path` run once per sample (module doc)."""

    def __init__(
        self,
        ctx: WorkflowContext,
        *,
        agent: AgentConfig | dict[str, Any] | None = None,
        sessions: SessionStore | None = None,
        model_name: str = "policy",
        turn_discount: float = 1.0,
        metrics: Any = None,
        api_metrics: Any = None,
    ) -> None:
        self.ctx = ctx
        self.config = agent if isinstance(agent, AgentConfig) else AgentConfig(**(agent or {}))
        if not self.config.path:
            raise ValueError("rollout.workflow=agent needs rollout.agent.path")
        self.agent = load_agent(self.config.path)
        self.sessions = sessions if sessions is not None else SessionStore()
        self.model_name = model_name
        self.turn_discount = turn_discount
        self.metrics = metrics  # services.rollout.metrics.AgentMetrics, or None
        self.api_metrics = api_metrics
        self._app: Any = None
        self._engine: Any = None

    def _api(self, engine: InferenceEngine) -> Any:
        """The replica's OpenAI app around `engine`, served in process on this loop."""
        if self._app is None or self._engine is not engine:
            api = ApiContext(
                bridge=EngineBridge(engine, None),
                store=self.sessions,
                model_names=[self.model_name],
                default_max_tokens=self.ctx.sampling.max_new_tokens,
                metrics=self.api_metrics,
            )
            self._app, self._engine = build_openai_app(api), engine
        return self._app

    async def _call_agent(
        self, session: Session, budget: EpisodeBudget, data: dict[str, Any]
    ) -> Any:
        http = episode_http_client(self._api(self._engine), budget, self.config.episode_timeout)
        base_url = session_base_url(session.id)
        try:
            if inspect.iscoroutinefunction(self.agent):
                client = openai.AsyncOpenAI(
                    base_url=base_url, api_key=IN_PROCESS_KEY, http_client=http, max_retries=0
                )
                return await self.agent(client, dict(data))
            return await self.agent.run(
                dict(data), base_url=base_url, http_client=http, api_key=IN_PROCESS_KEY
            )
        finally:
            await http.aclose()

    async def _run_one(self, engine: InferenceEngine, data: dict[str, Any]) -> Episode | str:
        """One episode, observed; the failure's reason when it failed (logged, counted)."""
        t0 = time.monotonic()
        tools: Counter[tuple[str, str]] = Counter()

        def hear(tool: str, outcome: str, _seconds: float) -> None:
            tools[(tool, outcome)] += 1
            if self.metrics is not None:
                self.metrics.observe_tool_call(tool, outcome)

        set_tool_listener(hear)  # this task's context: only this episode's calls
        try:
            episode = await self._episode(engine, data, tools)
        except AgentFailure as exc:
            log.warning(
                "agent episode failed",
                extra={"reason": exc.reason, "error": str(exc), "prompt_id": data.get("prompt_id")},
            )
            if self.metrics is not None:
                self.metrics.observe_failure(exc.reason, time.monotonic() - t0)
            return exc.reason
        episode.seconds = time.monotonic() - t0
        if self.metrics is not None:
            self.metrics.observe_episode(len(episode.session.calls), episode.seconds)
        return episode

    async def _episode(
        self, engine: InferenceEngine, data: dict[str, Any], tools: Counter[tuple[str, str]]
    ) -> Episode:
        """One episode, or `AgentFailure` with the reason."""
        self._api(engine)
        session = self.sessions.open()
        budget = EpisodeBudget(session, self.config)
        try:
            try:
                async with asyncio.timeout(self.config.episode_timeout):
                    value = await self._call_agent(session, budget, data)
            except TimeoutError:
                raise AgentFailure(
                    "timeout", f"episode passed its {self.config.episode_timeout:g} s"
                ) from None
            except BudgetExceeded as exc:
                raise AgentFailure(exc.reason, str(exc)) from None
            except Exception as exc:  # noqa: BLE001 - the agent is user code
                raise AgentFailure(
                    budget.failure or "error", f"{type(exc).__name__}: {exc}"
                ) from None
            if budget.failure:  # the agent swallowed the refusal and returned anyway
                raise AgentFailure(budget.failure, "the episode went over its budget")
            if not session.calls:
                raise AgentFailure("no_calls", "the agent made no model call")
            reward, extras = as_agent_reward(value)
            source = "agent"
            if reward is None:
                reward, source = await self._score(engine, session, data), "reward_service"
        finally:
            self.sessions.close(session.id)
        return Episode(session, reward, source, 0.0, tools, extras)

    async def _score(
        self, engine: InferenceEngine, session: Session, data: dict[str, Any]
    ) -> float:
        """The reward service's score of the episode's last answer."""
        first, last = session.calls[0], session.calls[-1]
        (score,) = await self.ctx.scorer.score(
            [
                ScoreRequest(
                    completion=engine.decode(last.output_ids),
                    answer=str(data.get("answer", "")),
                    prompt=str(data.get("prompt_text", "")),
                    prompt_ids=first.prompt_ids,
                    completion_ids=last.output_ids,
                    kwargs=reward_kwargs(data),
                )
            ]
        )
        if score.ok:
            return float(score.reward)
        self.ctx.on_reward_failure(score.status)
        if self.ctx.on_failure == "drop_group":
            raise AgentFailure("reward_failed", f"reward {score.status}: {score.message}")
        return 0.0

    def _trajectories(self, episode: Episode) -> list[Trajectory]:
        meta = {
            "reward_source": episode.source,
            "episode_seconds": f"{episode.seconds:.3f}",
            "tool_calls": str(sum(episode.tools.values())),
            "tool_failures": str(sum(n for (_, o), n in episode.tools.items() if o != "ok")),
        }
        if episode.info:
            meta["agent_info"] = json.dumps(episode.info, sort_keys=True)
        if self.config.export_style == "concat":
            trajs = [
                export_concat(episode.session, reward=episode.reward, group_id="", trajectory_id="")
            ]
        else:
            trajs = export_individual(episode.session, reward=episode.reward, group_id="")
            turns = [0.0] * (len(trajs) - 1) + [episode.reward]
            for traj, value in zip(
                trajs, discount_turn_rewards(turns, self.turn_discount), strict=True
            ):
                traj.reward = value
        for traj in trajs:
            traj.metadata.update(meta)
        return trajs

    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> TrajectoryGroup | None:
        n = self.ctx.sampling.n_samples
        episodes = await asyncio.gather(*(self._run_one(engine, data) for _ in range(n)))
        if "reward_failed" in episodes:  # reward.on_failure: drop_group
            return None
        trajectories = [
            t for e in episodes if isinstance(e, Episode) for t in self._trajectories(e)
        ]
        return make_group(trajectories, data) if trajectories else None
