"""Tool-use transcripts for a short `flywheel sft` warm start of the tool-math agent.

SmolLM2-135M-Instruct never writes a `<tool_call>` block on its own (0 of the held-out
problems, greedy or at temperature 1: `docs/agents.md`), so RL would have no successful
call to reinforce. A few SFT steps on these transcripts teach the format; RL then has
to make it reliable and the answer right.

Each training problem gives two rows in `flywheel sft`'s form (`prompt`: chat messages,
`answer`: the assistant's text). The messages are exactly what the replica's API renders
for the agent's calls (`examples/agents/tool_math.py`): the tools go through the API's own
renderer (`ChatRenderer.messages`), so the prompt the model is tuned on is the prompt it
later sees, and the call it learns to write is the text the API writes back for an
earlier call (no template drift between turns).

1. system + question  →  the calculator call;
2. system + question + that call + the tool's result  →  the result as the answer.

    python -m examples.agents.tool_math_transcripts examples/data/tool_math/train.jsonl \
        examples/data/tool_math/sft.jsonl --n 256
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from examples.agents.tool_math import SYSTEM, last_number
from services.reward.tools.calculator import SCHEMA as CALCULATOR
from services.reward.tools.calculator import evaluate
from services.rollout.data.arithmetic import write_jsonl
from services.rollout.data.datasets import read_rows
from services.rollout.openai_api.render import ChatRenderer
from services.rollout.openai_api.schemas import ChatMessage, ToolSpec
from services.rollout.openai_api.tool_calls import render_call_text


class _NoTemplate:
    """A tokenizer stand-in: the renderer only asks whether the template knows tools.
    SmolLM2's does not, so tools become system text (what the replica does for it)."""

    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def transcript_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    question = str(row["prompt"])
    expression = question.removeprefix("What is ").removesuffix("?")
    arguments = json.dumps({"expression": expression})
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": arguments},
    }
    result = evaluate(expression)
    assert last_number(result) == last_number(str(row["answer"]))
    renderer = ChatRenderer(_NoTemplate())
    tools = [ToolSpec.model_validate(CALCULATOR)]

    def messages(*extra: dict[str, Any]) -> list[dict[str, Any]]:
        base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        msgs, _ = renderer.messages([ChatMessage.model_validate(m) for m in (*base, *extra)], tools)
        return msgs

    return [
        {"prompt": messages(), "answer": render_call_text("calculator", arguments)},
        {
            "prompt": messages(
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": result},
            ),
            "answer": result,
        },
    ]


def warm_start_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Both transcript rows of every training problem: the launcher's warm start of
    `examples/smollm2_tool_math.yaml` (`launcher.warm_start.rows_fn`)."""
    return [t for row in rows for t in transcript_rows(row)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problems", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=256, help="problems to write transcripts of")
    args = parser.parse_args(argv)
    write_jsonl(args.out, warm_start_rows(read_rows(args.problems)[: args.n]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
