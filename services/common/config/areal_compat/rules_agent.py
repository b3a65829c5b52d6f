"""Translation of AReaL 2.0's agent block (`rollout.agent`, its `AgentConfig`) into
Flywheel's (`services/common/config/agent.py`).

AReaL runs an agent through an OpenAI proxy; Flywheel serves the same API on every
rollout replica and runs the agent in the replica's process (AReaL's `inline` mode). The
keys that mean the same thing are mapped: the agent's import path, the export style, the
turn discount, the per-call token limit, the session timeout (the episode deadline), and the inline mode and Qwen/Hermes tool-call
parser, which are what Flywheel does anyway. The rest (proxy orchestration, its admin key,
other parsers and modes) is reported as ignored, with why; the admin key's value is never
echoed into the report.
"""

from __future__ import annotations

from typing import Any

from .tree import ABSENT, TreeEditor

BLOCK = "rollout.agent"

_SAME_PARSER = ("qwen", "qwen25", "hermes")
"""SGLang's tool-call parser names for `<tool_call>{json}</tool_call>` blocks, the format
the replica's API parses (`services/rollout/openai_api/tool_calls.py`)."""

_FLYWHEEL_KEYS = ("path", "max_turns", "max_tokens_per_episode", "episode_timeout")
"""Flywheel's own keys of the block, passed through when an AReaL file sets them."""

_IGNORED = {
    "reasoning_parser": "the API returns reasoning text as content (no `<think>` split)",
    "scheduling_spec": "no agent-service workers: agents run inside the rollout replica",
    "subproc_max_workers": "agents run inline, in the rollout replica's event loop",
    "set_reward_finish_timeout": "the agent's return value is the episode's reward",
}


def _path(t: TreeEditor, value: Any) -> None:
    text = str(value)
    if text.startswith("areal."):
        t.ignored(
            f"{BLOCK}.agent_cls_path",
            value,
            "AReaL's own agent classes do not run here; set rollout.agent.path to your agent",
        )
        return
    t.set(f"{BLOCK}.path", text)
    mapped = f"{BLOCK}.path"
    if t.get("rollout.workflow") is None:
        t.set("rollout.workflow", "agent")
        mapped += " and rollout.workflow: agent"
    t.mapped(f"{BLOCK}.agent_cls_path", value, mapped)


def _session_timeout(t: TreeEditor, value: Any) -> None:
    """AReaL's proxy drops a session older than this, and the episode with it: the longest
    an episode may run, which is what `episode_timeout` bounds here (a Flywheel
    `episode_timeout` in the same block wins)."""
    dotted = f"{BLOCK}.session_timeout_seconds"
    if t.get(f"{BLOCK}.episode_timeout") is not None:
        t.ignored(dotted, value, "rollout.agent.episode_timeout, also set, bounds an episode")
        return
    t.set(f"{BLOCK}.episode_timeout", value)
    t.mapped(dotted, value, f"{BLOCK}.episode_timeout (an episode ends with its session)")


def _mode(t: TreeEditor, value: Any) -> None:
    if value == "inline":
        t.mapped(f"{BLOCK}.mode", value, "agents run in the rollout replica's process (inline)")
    else:
        t.ignored(f"{BLOCK}.mode", value, "agents run inline, in the rollout replica's process")


def _parser(t: TreeEditor, value: Any) -> None:
    if value in _SAME_PARSER:
        t.mapped(
            f"{BLOCK}.tool_call_parser",
            value,
            "the replica's API parses Qwen/Hermes <tool_call>{json}</tool_call> blocks",
        )
    else:
        t.ignored(
            f"{BLOCK}.tool_call_parser",
            value,
            "the replica's API parses Qwen/Hermes <tool_call> blocks only",
        )


def _template(t: TreeEditor, value: Any) -> None:
    if value == "hf":
        t.mapped(
            f"{BLOCK}.chat_template_type", value, "prompts are rendered with the model's template"
        )
    else:
        t.ignored(
            f"{BLOCK}.chat_template_type",
            value,
            "prompts are rendered with the model's template; for one trajectory per "
            "episode set rollout.agent.export_style: concat",
        )


def agent(t: TreeEditor) -> None:
    """Map `rollout.agent.*` (AReaL 2.0's `AgentConfig`) onto Flywheel's agent block."""
    block = t.pop(BLOCK)
    if block is ABSENT or not isinstance(block, dict):
        return
    t.set(BLOCK, {k: block.pop(k) for k in _FLYWHEEL_KEYS if k in block})
    for key, value in block.items():
        dotted = f"{BLOCK}.{key}"
        if key == "agent_cls_path":
            _path(t, value)
        elif key in ("export_style", "engine_max_tokens"):
            t.set(dotted, value)
            t.mapped(dotted, value, dotted)
        elif key == "turn_discount":
            t.set("rollout.turn_discount", value)
            t.mapped(dotted, value, "rollout.turn_discount")
        elif key == "session_timeout_seconds":
            _session_timeout(t, value)
        elif key == "mode":
            _mode(t, value)
        elif key == "tool_call_parser":
            _parser(t, value)
        elif key == "chat_template_type":
            _template(t, value)
        elif key == "admin_api_key":
            t.ignored(dotted, "<redacted>", "the API takes the services' token (auth_token)")
        else:
            t.ignored(dotted, value, _IGNORED.get(key, "AReaL's agent-service setting"))
