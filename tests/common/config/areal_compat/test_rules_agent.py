"""AReaL 2.0's agent block loads with its keys mapped
(`services/common/config/areal_compat/rules_agent.py`).

The agent block is written with AReaL's key names and the values of the config of AReaL's
own agent workflow example (`agent_workflow/config.yaml` in its examples; mode inline,
tool_call_parser qwen25, reasoning_parser qwen3, export_style individual, turn_discount 1.0) plus `agent_cls_path`
and `admin_api_key`, fields of AReaL 2.0's `AgentConfig` (areal/api/cli_args.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from services.common.config.areal_compat.rules_agent import agent
from services.common.config.areal_compat.tree import TreeEditor
from services.common.config.loader import load_with_report
from tests.common.config.test_areal_compat import ALGORITHMS

AREAL_AGENT_BLOCK: dict[str, Any] = {
    "agent_cls_path": "tests.rollout.workflows.agents:ArealStyle",
    "mode": "inline",
    "tool_call_parser": "qwen25",
    "reasoning_parser": "qwen3",
    "export_style": "concat",
    "turn_discount": 0.9,
    "engine_max_tokens": 2048,
    "session_timeout_seconds": 120,
    "admin_api_key": "sk-do-not-echo",
}


def test_an_areal_agent_block_loads_with_its_keys_mapped(tmp_path: Path) -> None:
    tree = yaml.safe_load(yaml.safe_dump(ALGORITHMS["grpo"][0]))
    tree["rollout"]["agent"] = dict(AREAL_AGENT_BLOCK)
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(tree))
    config, report = load_with_report(path)
    assert config.rollout.workflow == "agent"
    assert config.rollout.agent.path == "tests.rollout.workflows.agents:ArealStyle"
    assert config.rollout.agent.export_style == "concat"
    assert config.rollout.agent.engine_max_tokens == 2048
    assert config.rollout.turn_discount == 0.9
    assert config.rollout.agent.episode_timeout == 120.0
    rows = {r.key: r for r in report.translations if r.key.startswith("rollout.agent")}
    mapped = {k for k, r in rows.items() if r.action == "mapped"}
    assert mapped == {
        f"rollout.agent.{k}"
        for k in (
            "agent_cls_path",
            "mode",
            "tool_call_parser",
            "export_style",
            "turn_discount",
            "engine_max_tokens",
            "session_timeout_seconds",
        )
    }
    assert rows["rollout.agent.reasoning_parser"].action == "ignored"
    assert rows["rollout.agent.admin_api_key"].action == "ignored"
    assert "sk-do-not-echo" not in "\n".join(report.lines())


def test_modes_and_parsers_flywheel_does_not_have_are_reported_not_applied() -> None:
    t = TreeEditor(
        {
            "rollout": {
                "workflow": "rlvr",
                "agent": {
                    "agent_cls_path": "areal.experimental.openai.proxy.online_agent._OnlineAgent",
                    "mode": "online",
                    "tool_call_parser": "llama3",
                    "chat_template_type": "concat",
                    "max_turns": 4,
                },
            }
        }
    )
    agent(t)
    # Flywheel's own key passes through; AReaL's own class is not taken as the agent.
    assert t.out["rollout"] == {"workflow": "rlvr", "agent": {"max_turns": 4}}
    assert {r.key: r.action for r in t.rows} == {
        "rollout.agent.agent_cls_path": "ignored",
        "rollout.agent.mode": "ignored",
        "rollout.agent.tool_call_parser": "ignored",
        "rollout.agent.chat_template_type": "ignored",
    }


def test_flywheels_own_episode_timeout_wins_over_the_session_timeout() -> None:
    t = TreeEditor({"rollout": {"agent": {"episode_timeout": 30, "session_timeout_seconds": 3600}}})
    agent(t)
    assert t.out["rollout"]["agent"] == {"episode_timeout": 30}
    (row,) = t.rows
    assert (row.key, row.action) == ("rollout.agent.session_timeout_seconds", "ignored")
    assert "episode_timeout" in row.flywheel
