"""Workflows on the real torch engine; the scorer is a small fake here (scoring through the
real reward service is covered by the loop integration test)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from services.core.contracts import WorkflowContext
from services.core.types import SamplingParams, ScoreRequest, ScoreResult
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.workflows.base import load_workflow
from services.rollout.workflows.multi_turn import MultiTurnWorkflow
from tests.rollout.user_workflow import EchoWorkflow


class ScriptedScorer:
    """Returns the scripted results in order and records what it was asked."""

    def __init__(self, results: Sequence[ScoreResult]) -> None:
        self.results = list(results)
        self.seen: list[ScoreRequest] = []

    async def score(self, items: Sequence[ScoreRequest]) -> list[ScoreResult]:
        self.seen.extend(items)
        out, self.results = self.results[: len(items)], self.results[len(items) :]
        return out


def data_row(engine: TorchEngine, text: str = "12+34=") -> dict[str, Any]:
    ids = engine.tokenizer(text)["input_ids"]
    return {
        "prompt_id": "p1",
        "prompt": text,
        "prompt_text": text,
        "answer": "#### 46",
        "prompt_ids": ids,
        "level": 2,
    }


async def test_rlvr_builds_an_aligned_group(engine: TorchEngine) -> None:
    scorer = ScriptedScorer([ScoreResult(1.0), ScoreResult(0.0), ScoreResult(0.5)])
    ctx = WorkflowContext(
        engine.tokenizer, SamplingParams(n_samples=3, max_new_tokens=6, seed=7), scorer
    )
    wf = load_workflow("rlvr", ctx)
    row = data_row(engine)
    group = await wf.arun_episode(engine, row)
    assert group is not None and group.prompt_id == "p1" and len(group.trajectories) == 3
    assert group.rewards == [1.0, 0.0, 0.5]
    p = len(row["prompt_ids"])  # "12+34=" -> 6 tokens
    for t, req in zip(group.trajectories, scorer.seen, strict=True):
        n = t.num_tokens - p
        assert t.prompt_len == p == 6 and 1 <= n <= 6
        assert t.input_ids[:p].tolist() == row["prompt_ids"]
        assert t.input_ids[p:].tolist() == list(req.completion_ids)
        assert t.loss_mask.tolist() == [0] * p + [1] * n
        assert t.versions.tolist() == [-1] * p + [0] * n
        assert (t.logprobs[:p] == 0).all() and (t.logprobs[p:] < 0).all()
        assert t.no_eos == (t.stop_reason != "stop") and t.turn_ids is None
        assert t.metadata["reward_status"] == "OK"
        assert (
            req.answer == "#### 46"
            and req.prompt == "12+34="
            and req.kwargs == {"prompt_id": "p1", "level": 2}
        )
        assert req.completion == engine.decode(req.completion_ids)


async def test_rlvr_reward_failures_follow_on_failure(engine: TorchEngine) -> None:
    failures: list[str] = []
    bad = ScoreResult(0.0, ok=False, status="TIMEOUT", message="slow")
    ctx = WorkflowContext(
        engine.tokenizer,
        SamplingParams(n_samples=2, max_new_tokens=3, seed=1),
        ScriptedScorer([ScoreResult(1.0), bad]),
        on_failure="zero",
        on_reward_failure=failures.append,
    )
    group = await load_workflow("rlvr", ctx).arun_episode(engine, data_row(engine))
    assert group is not None and group.rewards == [1.0, 0.0]
    assert group.trajectories[1].metadata == {"reward_status": "TIMEOUT", "reward_error": "slow"}
    assert failures == ["TIMEOUT"]
    ctx.on_failure = "drop_group"
    ctx.scorer = ScriptedScorer([ScoreResult(1.0), bad])
    assert await load_workflow("rlvr", ctx).arun_episode(engine, data_row(engine)) is None


async def test_multi_turn_feedback_turn_ids_and_discount(engine: TorchEngine) -> None:
    # First answer wrong (0), second right (1): reward 1 * 0.5 ** (2 - 1) = 0.5.
    scorer = ScriptedScorer([ScoreResult(0.0), ScoreResult(1.0)])
    ctx = WorkflowContext(
        engine.tokenizer,
        SamplingParams(n_samples=1, max_new_tokens=4, ignore_eos=True, seed=3),
        scorer,
    )
    wf = MultiTurnWorkflow(ctx, max_turns=3, turn_discount=0.5, feedback="\n#\n")
    row = data_row(engine)
    group = await wf.arun_episode(engine, row)
    assert group is not None
    (t,) = group.trajectories
    p, fb = 6, engine.tokenizer("\n#\n")["input_ids"]  # 3 feedback tokens
    assert t.reward == pytest.approx(0.5) and t.metadata["turns"] == "2"
    assert t.turn_ids.tolist() == [-1] * p + [0] * 4 + [-1] * 3 + [1] * 4
    assert t.loss_mask.tolist() == [0] * p + [1] * 4 + [0] * 3 + [1] * 4
    assert t.input_ids[p + 4 : p + 7].tolist() == fb
    assert t.versions.tolist() == [-1] * p + [0] * 4 + [-1] * 3 + [0] * 4
    assert (t.logprobs[p + 4 : p + 7] == 0).all()
    # The second turn was generated from prompt + answer 1 + feedback.
    assert list(scorer.seen[1].completion_ids) == t.input_ids[p + 7 :].tolist()


async def test_multi_turn_stops_at_max_turns(engine: TorchEngine) -> None:
    scorer = ScriptedScorer([ScoreResult(0.0)] * 4)
    ctx = WorkflowContext(
        engine.tokenizer,
        SamplingParams(n_samples=2, max_new_tokens=2, ignore_eos=True, seed=3),
        scorer,
    )
    group = await MultiTurnWorkflow(ctx, max_turns=2, feedback="#").arun_episode(
        engine, data_row(engine)
    )
    assert group is not None and group.rewards == [0.0, 0.0]
    for t in group.trajectories:
        # prompt 6 + answer 2 + feedback 1 + answer 2
        assert t.num_tokens == 11 and np.unique(t.turn_ids).tolist() == [-1, 0, 1]


def test_load_workflow_by_name_or_dotted_path(engine: TorchEngine) -> None:
    ctx = WorkflowContext(None, SamplingParams(), ScriptedScorer([]))
    wf = load_workflow("tests.rollout.user_workflow.EchoWorkflow", ctx, tag="x")
    assert isinstance(wf, EchoWorkflow) and wf.tag == "x"
    with pytest.raises(ValueError, match="unknown; use one of"):
        load_workflow("nope", ctx)
    with pytest.raises(ValueError, match="cannot be imported"):
        load_workflow("tests.rollout.missing.Thing", ctx)
    with pytest.raises(ValueError, match="arun_episode"):
        load_workflow("tests.rollout.user_workflow.NotAWorkflow", ctx)
