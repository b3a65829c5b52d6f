"""The agent block (`rollout.agent`): which agent to run and the limits of one episode.

AReaL 2.0's names where the meaning is the same (`export_style`, and `agent_cls_path`
read as `path`: the translation of an AReaL file maps it); the limits are Flywheel's,
because a Flywheel agent runs inside the rollout replica and must not be able to stall
it: every episode has a deadline, a most number of model calls and a token budget, and
an episode that breaks one of them fails alone (`docs/agents.md`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ._base import FlywheelModel, RuleViolation


class AgentConfig(FlywheelModel):
    """The user's agent, run `gconfig.n_samples` times per prompt by `rollout.workflow:
    agent`, each run with an OpenAI client bound to a fresh session of the replica."""

    path: str = ""
    """Dotted path of the agent: `async def run(client: openai.AsyncOpenAI, data: dict)
    -> float | dict | None`, or a class with AReaL's `async def run(self, data,
    **extra_kwargs)` (given `base_url`, `http_client` and `api_key`). AReaL's
    `agent_cls_path`. Returning None lets the reward service score the episode."""

    export_style: Literal["individual", "concat"] = "individual"
    """AReaL's export styles: `individual`, one trajectory per model call, each with the
    episode's reward (discounted by `rollout.turn_discount` per call from the last); or
    `concat`, one trajectory per episode with tool and user tokens masked out of the loss
    and `turn_ids` set (linear conversations only)."""

    max_turns: int = Field(default=8, ge=1)
    """Flywheel: most model calls in one episode; one more call fails the episode
    (`max_turns`)."""

    max_tokens_per_episode: int = Field(default=4096, ge=1)
    """Flywheel: most sampled tokens in one episode, all calls together; a call made with
    the budget spent fails the episode (`token_budget`)."""

    engine_max_tokens: int | None = Field(default=None, ge=1)
    """Most tokens (prompt + completion) of one call (AReaL's `engine_max_tokens`); a call
    past it fails the episode (`context_budget`). Null: the model's context bounds it."""

    episode_timeout: float = Field(default=300.0, gt=0.0)
    """Flywheel: seconds one episode may take, tool calls and scoring included; then the
    agent is cancelled and the episode fails (`timeout`). Keep it below
    `rollout.request_timeout`, which bounds the whole group."""

    @model_validator(mode="after")
    def _path_is_dotted(self) -> AgentConfig:
        if self.path and "." not in self.path and ":" not in self.path:
            raise RuleViolation(
                "path",
                self.path,
                "name the agent by dotted path, e.g. `examples.agents.tool_math:run`",
            )
        return self
