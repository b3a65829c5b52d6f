"""docs/extending.md: its examples are the files under examples/extending/, shown as they
are, and each one runs through the code path its config key selects (the loaders of
services/api.py, the buffer's and the trainer's filter, the trainer's loss and advantages,
the rollout's workflow on the real torch engine, `flywheel run --dry-run`)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from services import cli
from services.api import (
    ScoreRequest,
    ScoreResult,
    TrajectoryGroup,
    WorkflowContext,
    load_dotted,
)
from services.buffer.filters import resolve_filter
from services.common.config import PPOActorConfig
from services.common.config.views import ActorLossView, AdvantageView
from services.core.filters import resolve_should_accept
from services.core.types import SamplingParams, Trajectory
from services.reward.registry import RewardRegistry, load_callable
from services.rollout.engine.torch_engine import TorchEngine
from services.rollout.workflows.base import build_trajectory, load_workflow
from services.trainer.algorithms import actor_loss, compute_advantages
from tests.fixtures_models import tiny_model_dir  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "extending"
DOC = ROOT / "docs" / "extending.md"
PKG = "examples.extending"


def test_the_page_shows_every_example_as_it_is() -> None:
    doc = DOC.read_text()
    files = sorted(EXAMPLES.glob("*.py"))
    assert [f.stem for f in files] == [
        "gae_lambda",
        "group_filter",
        "reward",
        "surrogate",
        "workflow",
    ]
    for f in files:
        assert f"`examples/extending/{f.name}`:\n\n```python\n{f.read_text()}```\n" in doc, f.name
    # and every python block on the page is one of the files
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert sorted(blocks) == sorted(f.read_text() for f in files)


# ------------------------------------------------------------------------------ reward


def test_reward_example_through_the_reward_registry() -> None:
    registry = RewardRegistry({"last_number": f"{PKG}.reward:last_number_reward"})
    fn = load_callable(registry.resolve("last_number").path)
    assert fn("12+34=", "so it is 46", [], [], "#### 46") == 1.0
    assert fn("12+34=", "46, no: 45", [], [], "#### 46") == 0.0  # the last number counts
    assert fn("12+34=", "no idea", [], [], "#### 46") == 0.0


# ---------------------------------------------------------------------------- workflow


class InProcessScorer:
    """Stand-in for the reward service: scores with the example reward function in this
    process (the service's own path is covered by the reward and rollout-loop tests)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.fn = load_callable(f"{PKG}.reward:last_number_reward")

    async def score(self, items: Sequence[ScoreRequest]) -> list[ScoreResult]:
        if self.fail:
            return [ScoreResult(0.0, ok=False, status="TIMEOUT") for _ in items]
        return [
            ScoreResult(self.fn(i.prompt, i.completion, [], list(i.completion_ids), i.answer))
            for i in items
        ]


async def test_workflow_example_on_the_torch_engine(tiny_model_dir: Path) -> None:  # noqa: F811
    engine = TorchEngine(tiny_model_dir, max_batch_size=3, device="cpu")
    await engine.start()
    try:
        await _run_workflow_example(engine)
    finally:
        await engine.stop()


async def _run_workflow_example(engine: TorchEngine) -> None:
    sampling = SamplingParams(n_samples=3, max_new_tokens=6, seed=7)
    ctx = WorkflowContext(engine.tokenizer, sampling, InProcessScorer())
    workflow = load_workflow(f"{PKG}.workflow.LengthPenaltyWorkflow", ctx, penalty_per_token=0.01)
    ids = engine.tokenizer("12+34=")["input_ids"]
    row = {"prompt_id": "p1", "prompt": "12+34=", "answer": "#### 46", "prompt_ids": ids}
    group = await workflow.arun_episode(engine, row)
    assert group is not None and len(group.trajectories) == 3
    for t in group.trajectories:
        generated = int(t.loss_mask.sum())
        assert 1 <= generated <= 6 and t.prompt_len == len(ids)
        text = engine.decode(t.input_ids[len(ids) :].tolist())
        base = 1.0 if re.findall(r"-?\d+(?:\.\d+)?", text)[-1:] == ["46"] else 0.0
        # reward = score - 0.01 per generated token
        assert math.isclose(t.reward, base - 0.01 * generated, abs_tol=1e-9)
    failing = WorkflowContext(engine.tokenizer, sampling, InProcessScorer(fail=True))
    skipped = load_workflow(f"{PKG}.workflow.LengthPenaltyWorkflow", failing)
    assert await skipped.arun_episode(engine, row) is None  # a failed reward skips the row


# ------------------------------------------------------------------------ group filters


def group(*rewards: float) -> TrajectoryGroup:
    trajectories: list[Trajectory] = [
        build_trajectory([1, 2], [([3], [-0.5], [0], 0)], reward=r, stop_reason="stop")
        for r in rewards
    ]
    return TrajectoryGroup("g", trajectories)


def test_group_filter_examples_in_the_buffer_and_the_trainer() -> None:
    some_solved = resolve_filter(f"{PKG}.group_filter:some_solved")
    assert some_solved is not None
    assert some_solved(group(0.0, 1.0)) is True and some_solved(group(0.0, 0.5)) is False
    wide = resolve_should_accept(
        PPOActorConfig(should_accept_fn=f"{PKG}.group_filter:wide_spread").should_accept_fn
    )
    # max - min >= 0.5: 1.0 - 0.0 keeps, 0.4 - 0.2 drops
    assert wide(group(0.0, 1.0)) is True and wide(group(0.2, 0.4)) is False
    # the same filter in the other place: one signature
    buffer_wide = resolve_filter(f"{PKG}.group_filter:wide_spread")
    assert buffer_wide is not None and buffer_wide(group(0.2, 0.4)) is False
    # already a group filter: used as it is, not adapted a second time
    assert buffer_wide is load_dotted(f"{PKG}.group_filter:wide_spread")


def test_a_filter_of_the_older_form_is_adapted() -> None:
    # `_spread(rewards, minimum)`: its first parameter is `rewards`, so the loader adapts it;
    # `minimum` has no default, so calling it without binding it is the function's TypeError.
    fn = resolve_should_accept(
        PPOActorConfig(should_accept_fn=f"{PKG}.group_filter:_spread").should_accept_fn
    )
    with pytest.raises(TypeError, match="minimum"):
        fn(group(0.0, 1.0))


# ------------------------------------------------------------------------------ trainer


def test_gae_lambda_example_in_the_advantages() -> None:
    # No critic (V = 0), γ = 1, one reward 1 at the end: A_t = λ^(T-1-t).
    # Trajectory 0 has 3 generated tokens > threshold 2: λ = 0.95 → [0.9025, 0.95, 1];
    # trajectory 1 has 2 <= 2: λ = 1 → [1, 1] (then padding).
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    actor = PPOActorConfig(
        gae_lambda=f"{PKG}.gae_lambda:by_length", gae_lambda_kwargs={"threshold": 2}
    )
    result = compute_advantages(
        AdvantageView.of(actor),
        rewards=torch.tensor([1.0, 1.0]),
        loss_mask=mask,
        no_eos=torch.tensor([False, False]),
    )
    expected = torch.tensor([[0.9025, 0.95, 1.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(
        torch.where(mask, result.advantages, 0.0), expected, rtol=0, atol=1e-6
    )


def test_surrogate_example_from_the_config() -> None:
    actor = PPOActorConfig(
        surrogate=f"{PKG}.surrogate:unclipped", eps_clip=0.2, loss_agg_mode="token-mean"
    )
    # ρ = exp(log 0.5 - log 0.25) = 2 on every token, far outside [0.8, 1.2]: clip would cap
    # it, the example does not. Token mean of -A ρ over A = [1, -1, 0.5]: -(2 - 2 + 1) / 3.
    logprobs = torch.full((1, 3), math.log(0.5), requires_grad=True)
    behave = torch.full((1, 3), math.log(0.25))
    advantages = torch.tensor([[1.0, -1.0, 0.5]])
    loss, stats = actor_loss(
        ActorLossView.of(actor),
        logprobs,
        advantages,
        torch.ones(1, 3, dtype=torch.bool),
        behave_logprobs=behave,
    )
    torch.testing.assert_close(loss, torch.tensor(-1.0 / 3.0), rtol=0, atol=1e-6)
    loss.backward()
    assert logprobs.grad is not None
    # d(-A ρ / 3)/d log π = -A ρ / 3
    torch.testing.assert_close(
        logprobs.grad, torch.tensor([[-2.0, 2.0, -1.0]]) / 3.0, rtol=0, atol=1e-6
    )
    assert not bool(stats["clip_mask"].any())


# ------------------------------------------------------------------------------ dry run


def test_dry_run_imports_every_example(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        [
            "run",
            "--config",
            str(ROOT / "examples" / "grpo.yaml"),
            "--dry-run",
            f"reward.fn={PKG}.reward:last_number_reward",
            f"rollout.workflow={PKG}.workflow.LengthPenaltyWorkflow",
            f"buffer.filter={PKG}.group_filter:some_solved",
            f"actor.should_accept_fn={PKG}.group_filter:wide_spread",
            f"actor.gae_lambda={PKG}.gae_lambda:by_length",
            "actor.gae_lambda_kwargs={threshold: 128}",
            f"actor.surrogate={PKG}.surrogate:unclipped",
            "actor.use_decoupled_loss=false",
            "actor.rejection_sampling=null",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"surrogate: {PKG}.surrogate:unclipped" in out.out
