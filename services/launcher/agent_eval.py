"""Held-out evaluation of an agent run: the user's agent itself, on every replica's OpenAI API.

An agent run (`rollout.workflow: agent`) is scored by what its agent does, not by one
completion of the bare prompt: the answer may come only after a tool call and its result.
So the launcher runs the same agent (`rollout.agent.path`) once per held-out row, as a
client from outside the replica: it opens a session (`POST /sessions` on the replica's
HTTP port), hands the agent an `openai.AsyncOpenAI` bound to the session's base URL, and
closes the session afterwards (`DELETE /sessions/{id}`), whose records name the weight
versions that produced the episode's tokens. Rows go to the replicas in turn, at most
`concurrency` episodes at a time.

Accuracy counts episodes whose reward is >= 1 over all rows (a failed episode, one that
raises, passes the deadline or returns no number, counts as wrong and as a failure). The
agent's tool calls are heard through the same per-episode listener the agent workflow
sets (`services.core.tool_events`), so the evaluation also reports the share of episodes
that called a tool (`tool_call_rate`) and the share of tool calls that succeeded
(`tool_success_rate`, None when no call was made). An agent that returns None (leaving
the score to the reward service) cannot be scored here and counts as a failure.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import openai

from services.common.config import FlywheelConfig
from services.core.plugins import load_dotted
from services.core.tool_events import set_tool_listener

NO_TOKEN = "none"
"""The API key sent when the run has no authentication (the client insists on one)."""


def importable_from_cwd() -> None:
    """Make user code (`examples.agents...`) importable here as in the services: they run as
    `python -m services.<name>` from the working directory, which puts it on `sys.path`;
    the `flywheel` console script does not."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


@dataclass
class AgentEvalResult:
    accuracy: float
    mean_reward: float
    n: int
    version: int  # the newest weight version that produced a token (-1: none did)
    failures: int
    version_min: int = -1
    tool_call_rate: float = 0.0
    tool_success_rate: float | None = None
    tool_calls: int = 0
    failure_reasons: dict[str, int] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The entries an evaluation record (`evals.jsonl`, `summary.json`) gains."""
        return {
            "tool_call_rate": self.tool_call_rate,
            "tool_success_rate": self.tool_success_rate,
            "tool_calls": self.tool_calls,
            "failure_reasons": self.failure_reasons,
        }

    def describe_tools(self) -> str:
        success = "-" if self.tool_success_rate is None else f"{self.tool_success_rate:.3f}"
        return f"tool-call rate {self.tool_call_rate:.3f}, tool success {success}"


@dataclass
class _Episode:
    reward: float | None
    tools: Counter[str]
    versions: list[int]
    failure: str = ""


def _reward_of(value: Any) -> float | None:
    """The agent's number (or its dict's `reward`), None when it returned no finite one."""
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return None


async def _call(
    agent: Any, client: openai.AsyncOpenAI, base_url: str, key: str, row: dict[str, Any]
) -> Any:
    if inspect.isclass(agent):  # AReaL's style: a class with `async run(data, **extra)`
        instance: Any = agent()
        return await instance.run(dict(row), base_url=base_url, api_key=key)
    return await agent(client, dict(row))


async def _episode(
    root: openai.AsyncOpenAI, agent: Any, row: dict[str, Any], key: str, timeout: float
) -> _Episode:
    tools: Counter[str] = Counter()

    def hear(tool: str, outcome: str, _seconds: float) -> None:
        tools[outcome] += 1

    set_tool_listener(hear)  # this task's context: only this episode's calls
    opened = await root.post("/sessions", cast_to=object, body={})
    sid = str(opened["id"])  # type: ignore[index]
    base_url = f"{root.base_url}sessions/{sid}/v1"
    client = root.with_options(base_url=base_url)
    reward: float | None = None
    failure = ""
    try:
        async with asyncio.timeout(timeout):
            reward = _reward_of(await _call(agent, client, base_url, key, row))
        if reward is None:
            failure = "bad_reward"
    except TimeoutError:
        failure = "timeout"
    except Exception as exc:  # noqa: BLE001 - the agent is user code
        failure = type(exc).__name__
    finally:
        record = await root.delete(f"/sessions/{sid}", cast_to=object)
    versions = [v for c in record["calls"] for v in c["versions"]]  # type: ignore[index]
    return _Episode(reward, tools, versions, failure)


async def evaluate_agent_async(
    base_urls: list[str],
    agent_path: str,
    rows: list[dict[str, Any]],
    *,
    auth_token: str | None = None,
    episode_timeout: float = 300.0,
    concurrency: int = 64,
) -> AgentEvalResult:
    """Run the agent at `agent_path` once per row against the replicas at `base_urls`
    (`http://host:port`), spread in turn; see the module docstring."""
    importable_from_cwd()
    agent = load_dotted(agent_path, "rollout.agent.path", require_callable=True)
    key = auth_token or NO_TOKEN
    roots = [
        openai.AsyncOpenAI(
            base_url=u.rstrip("/") + "/", api_key=key, max_retries=0, timeout=episode_timeout
        )
        for u in base_urls
    ]
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, row: dict[str, Any]) -> _Episode:
        async with gate:
            return await _episode(roots[i % len(roots)], agent, row, key, episode_timeout)

    try:
        episodes = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    finally:
        for root in roots:
            await root.close()
    return summarize(episodes)


def summarize(episodes: list[_Episode]) -> AgentEvalResult:
    n = len(episodes)
    rewards = [e.reward or 0.0 for e in episodes]
    calls = sum(sum(e.tools.values()) for e in episodes)
    ok = sum(e.tools["ok"] for e in episodes)
    versions = [v for e in episodes for v in e.versions]
    reasons = Counter(e.failure for e in episodes if e.failure)
    return AgentEvalResult(
        accuracy=sum(r >= 1.0 - 1e-6 for r in rewards) / n if n else 0.0,
        mean_reward=sum(rewards) / n if n else 0.0,
        n=n,
        version=max(versions, default=-1),
        version_min=min(versions, default=-1),
        failures=sum(reasons.values()),
        tool_call_rate=sum(bool(e.tools) for e in episodes) / n if n else 0.0,
        tool_success_rate=ok / calls if calls else None,
        tool_calls=calls,
        failure_reasons=dict(reasons),
    )


class AgentEvaluator:
    """Runs `evaluate_agent_async` for the launcher's synchronous supervisor, always on the
    same event loop (a thread of its own): an agent's process-wide helpers, such as a tool
    sandbox's worker processes and their pipes, belong to the loop they started on."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agent-eval", daemon=True)
        self.thread.start()

    def evaluate(
        self, base_urls: list[str], agent_path: str, rows: list[dict[str, Any]], **kw: Any
    ) -> AgentEvalResult:
        coro = evaluate_agent_async(base_urls, agent_path, rows, **kw)
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        except openai.APIError as err:  # a replica restarting: the caller skips this one
            raise RuntimeError(f"agent evaluation failed: {err}") from err

    def evaluate_run(
        self, cfg: FlywheelConfig, rows: list[dict[str, Any]], auth_token: str | None
    ) -> AgentEvalResult:
        """The held-out evaluation of the local run `cfg`: every replica of the run, its
        agent, its episode deadline."""
        ro = cfg.services.rollout  # a local run's replicas: on this host, HTTP on metrics_port
        urls = [
            f"http://127.0.0.1:{ro.replica_port(i, 'metrics_port')}"
            for i in range(cfg.rollout.n_replicas)
        ]
        return self.evaluate(
            urls,
            str(cfg.rollout.agent.path),
            rows,
            auth_token=auth_token,
            episode_timeout=cfg.rollout.agent.episode_timeout,
            # An episode's deadline runs from its start, so a queue of evaluation episodes
            # on a busy replica does not eat into it: as many at once as the rollout runs.
            concurrency=cfg.rollout.max_concurrent_rollouts or 16,
        )

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
